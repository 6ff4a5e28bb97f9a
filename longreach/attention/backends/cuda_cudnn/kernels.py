"""Two Triton kernels of the ``cuda_cudnn`` backend (:mod:`..cuda_cudnn`), for the work around its calls of cuDNN's
attention: turning the moved queries and keys (:func:`rotated`) and merging the blocks into the model's output
(:func:`merge_into`).

Each replaces several elementwise launches: :func:`...rotary.apply_rotation` is six, and a block merged by
:func:`...merge.merge_into` seven more, into a float32 ``[B, H, L, D]`` result the kernel then transposes and casts.
:func:`merge_into` reads every block once and writes the model's dtype in ``[B, L, H, D]``. Both take host integers
only (shapes, strides, the plan's row ranges): no host sync, no upload per call.

Blocks are passed as tuples of tensors, which Triton takes from 3.3 on (CUDA builds of torch 2.7 ship it); without
them :data:`FUSED` is False. Runs compiled on CUDA, and on the CPU under Triton's interpreter
(``TRITON_INTERPRET=1``), which the tests use.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import NamedTuple

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installed packages
    triton = None

FUSED = triton is not None and tuple(int(part) for part in triton.__version__.split(".")[:2]) >= (3, 3)
"""Whether the kernels run here: Triton is installed and takes tuples of tensors."""

ROTATION_ROWS = 32  # token rows per program of the rotation
ROTATION_HEADS = 4  # heads per program of the rotation: a per-token angle is read once for all of them
MERGE_ROWS = 32  # query rows per program of the merge


if FUSED:

    @triton.jit
    def _rotate(
        source,
        s_batch,
        s_head,
        s_row,
        s_dim,
        cos,
        sin,
        a_batch,
        a_row,
        a_pair,
        moved,
        m_batch,
        m_head,
        m_row,
        heads,
        length,
        PAIRS: tl.constexpr,
        PAIRS_P: tl.constexpr,
        REST: tl.constexpr,
        REST_P: tl.constexpr,
        ROWS: tl.constexpr,
        HEADS: tl.constexpr,
    ):
        """RoPE's rotation (Su et al. 2021, Eq. 34) of the pairs ``(x_k, x_{k+P})`` by the angles whose ``cos`` and
        ``sin`` are given, ``(x1 cos - x2 sin, x2 cos + x1 sin)`` in the angles' dtype, the dimensions past ``2P`` as
        they are: for ``ROWS`` tokens of one sequence and ``HEADS`` heads, each token's angles read once."""
        row = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
        batch = tl.program_id(1).to(tl.int64)
        first_head = tl.program_id(2) * HEADS
        pair = tl.arange(0, PAIRS_P)
        rows_ok = row < length
        pairs_ok = rows_ok[:, None] & (pair < PAIRS)[None, :]
        angle_at = batch * a_batch + row[:, None] * a_row + pair[None, :] * a_pair
        c = tl.load(cos + angle_at, mask=pairs_ok, other=1.0)
        s = tl.load(sin + angle_at, mask=pairs_ok, other=0.0)
        for i in range(HEADS):
            head = (first_head + i).to(tl.int64)
            if head < heads:
                x = source + batch * s_batch + head * s_head + row[:, None] * s_row
                y = moved + batch * m_batch + head * m_head + row[:, None] * m_row
                x1 = tl.load(x + pair[None, :] * s_dim, mask=pairs_ok, other=0.0)
                x2 = tl.load(x + (PAIRS + pair[None, :]) * s_dim, mask=pairs_ok, other=0.0)
                a, b = x1.to(c.dtype), x2.to(c.dtype)
                tl.store(y + pair[None, :], (a * c - b * s).to(x1.dtype), mask=pairs_ok)
                tl.store(y + PAIRS + pair[None, :], (b * c + a * s).to(x1.dtype), mask=pairs_ok)
                if REST > 0:
                    extra = tl.arange(0, REST_P)
                    rest_ok = rows_ok[:, None] & (extra < REST)[None, :]
                    rest = tl.load(x + (2 * PAIRS + extra[None, :]) * s_dim, mask=rest_ok)
                    tl.store(y + 2 * PAIRS + extra[None, :], rest, mask=rest_ok)

    @triton.jit
    def _merge(
        outs,
        out_strides,
        lses,
        lse_strides,
        merged,
        m_batch,
        m_head,
        m_row,
        m_dim,
        total_lse,
        t_batch,
        t_head,
        t_row,
        heads,
        rows,
        DIM: tl.constexpr,
        DIM_P: tl.constexpr,
        ROWS: tl.constexpr,
        WRITE_LSE: tl.constexpr,
    ):
        """Softmax attentions over disjoint key sets merged by their log-sum-exps (the combine of Flash-Decoding,
        Dao et al. 2023): ``O = sum_b exp(lse_b - lse) O_b`` with ``lse = log sum_b exp(lse_b)``, the maximum and the
        sum found in one pass over the log-sum-exps (Milakov and Gimelshein 2018, Algorithm 3), then one pass over the
        outputs. A row empty in every block (all ``-inf``) is 0 with ``lse = -inf``. For ``ROWS`` rows of one head."""
        row = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
        batch = (tl.program_id(1) // heads).to(tl.int64)
        head = (tl.program_id(1) % heads).to(tl.int64)
        dim = tl.arange(0, DIM_P)
        rows_ok = row < rows
        ok = rows_ok[:, None] & (dim < DIM)[None, :]
        top = tl.full([ROWS], float("-inf"), tl.float32)
        total = tl.zeros([ROWS], tl.float32)
        for i in tl.static_range(len(lses)):
            at = batch * lse_strides[3 * i] + head * lse_strides[3 * i + 1] + row * lse_strides[3 * i + 2]
            lse = tl.load(lses[i] + at, mask=rows_ok, other=float("-inf")).to(tl.float32)
            new_top = tl.maximum(top, lse)
            shift = tl.where(new_top == float("-inf"), 0.0, new_top)
            total = total * tl.exp(top - shift) + tl.exp(lse - shift)
            top = new_top
        shift = tl.where(top == float("-inf"), 0.0, top)
        reached = total > 0  # some piece has a key for the row
        kept = tl.where(reached, total, 1.0)
        share = tl.where(reached, 1.0 / kept, 0.0)
        acc = tl.zeros([ROWS, DIM_P], tl.float32)
        for i in tl.static_range(len(outs)):
            at = batch * lse_strides[3 * i] + head * lse_strides[3 * i + 1] + row * lse_strides[3 * i + 2]
            lse = tl.load(lses[i] + at, mask=rows_ok, other=float("-inf")).to(tl.float32)
            weight = tl.exp(lse - shift) * share
            at = (
                batch * out_strides[4 * i]
                + head * out_strides[4 * i + 1]
                + row[:, None] * out_strides[4 * i + 2]
                + dim[None, :] * out_strides[4 * i + 3]
            )
            part = tl.load(outs[i] + at, mask=ok & (weight > 0)[:, None], other=0.0).to(tl.float32)
            acc += part * weight[:, None]
        at = batch * m_batch + head * m_head + row[:, None] * m_row + dim[None, :] * m_dim
        tl.store(merged + at, acc.to(merged.dtype.element_ty), mask=ok)
        if WRITE_LSE:
            lse = tl.where(reached, shift + tl.log(kept), float("-inf"))
            tl.store(total_lse + batch * t_batch + head * t_head + row * t_row, lse, mask=rows_ok)


def rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [B, H, L, D]`` turned by the angles ``cos``, ``sin`` as :func:`...rotary.apply_rotation` turns it, in one
    launch: the pairs ``(x_k, x_{k+P})`` computed in the angles' dtype, the dimensions past ``2P`` unchanged, the result
    in ``x``'s dtype, contiguous. The angles are ``[P]`` or ``[1, P]`` (a constant shift), ``[B, L, P]`` or
    ``[B, 1, L, P]`` (a shift per token, the same in every head)."""
    batch, heads, length, dim = x.shape
    pairs = cos.shape[-1]
    if 2 * pairs > dim:
        raise ValueError(f"{pairs} rotary pairs do not fit a head of {dim} dimensions")
    if cos.dim() == 4 and cos.shape[1] != 1:
        raise ValueError(f"angles of shape {tuple(cos.shape)} differ per head; the rotation takes one set per token")
    cos, sin = (a.squeeze(1) if a.dim() == 4 else a for a in (cos, sin))
    cos, sin = (a.expand(batch, length, pairs) for a in (cos, sin))  # strides 0 where an angle is shared
    if cos.stride() != sin.stride():  # one set of strides for both
        cos, sin = cos.contiguous(), sin.contiguous()
    moved = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(length, ROTATION_ROWS), batch, triton.cdiv(heads, ROTATION_HEADS))
    _rotate[grid](
        x,
        *x.stride(),
        cos,
        sin,
        *cos.stride(),
        moved,
        *moved.stride()[:3],
        heads,
        length,
        PAIRS=pairs,
        PAIRS_P=triton.next_power_of_2(pairs),
        REST=dim - 2 * pairs,
        REST_P=triton.next_power_of_2(max(1, dim - 2 * pairs)),
        ROWS=ROTATION_ROWS,
        HEADS=ROTATION_HEADS,
    )
    return moved


class Piece(NamedTuple):
    """One block's softmax attention over its keys, for :func:`merge_into`: ``out [B, H, T, D]`` and
    ``lse [B, H, T]`` of the query rows ``first .. first + T - 1``, stored last row first where ``reversed`` (a
    :attr:`...plan.Block.flipped` block's result, read in place of turning it back)."""

    out: torch.Tensor
    lse: torch.Tensor
    first: int
    reversed: bool = False

    @property
    def stop(self) -> int:
        return self.first + self.out.shape[2]

    def rows_from(self, row: int) -> tuple[torch.Tensor, tuple[int, ...], torch.Tensor, tuple[int, ...]]:
        """``(out, its strides, lse, its strides)`` whose row 0 is query row ``row``: views, with negated row strides
        where the rows are stored reversed."""
        if not self.reversed:
            at = row - self.first
            return self.out[:, :, at:], self.out.stride(), self.lse[:, :, at:], self.lse.stride()
        at = self.stop - 1 - row
        out_strides, lse_strides = list(self.out.stride()), list(self.lse.stride())
        out_strides[2], lse_strides[2] = -out_strides[2], -lse_strides[2]
        return self.out[:, :, at:], tuple(out_strides), self.lse[:, :, at:], tuple(lse_strides)


def merge_into(pieces: Sequence[Piece], out: torch.Tensor, lse: torch.Tensor | None = None) -> None:
    """Write the pieces merged by their log-sum-exps into ``out [B, L, H, D]`` (any dtype: accumulated in float32,
    rounded once) and, if given, their total log-sum-exp into ``lse [B, H, L]``; rows no piece covers are 0 and
    ``-inf``.

    One launch per run of rows covered by the same pieces (a band's chunk, the rows an unbounded part reaches): each
    row is read from every piece that covers it and written once."""
    batch, length, heads, dim = out.shape
    edges = sorted({0, length, *(p.first for p in pieces), *(p.stop for p in pieces)})
    for start, stop in itertools.pairwise(edges):
        covering = [p for p in pieces if p.first <= start and stop <= p.stop]
        if not covering:
            out[:, start:stop].zero_()
            if lse is not None:
                lse[:, :, start:stop].fill_(float("-inf"))
            continue
        views = [p.rows_from(start) for p in covering]
        total = lse[:, :, start:] if lse is not None else out
        _merge[(triton.cdiv(stop - start, MERGE_ROWS), batch * heads)](
            tuple(v[0] for v in views),
            tuple(stride for v in views for stride in v[1]),
            tuple(v[2] for v in views),
            tuple(stride for v in views for stride in v[3]),
            out[:, start:],
            out.stride(0),
            out.stride(2),
            out.stride(1),
            out.stride(3),
            total,
            *(total.stride()[:3] if lse is not None else (0, 0, 0)),
            heads,
            stop - start,
            DIM=dim,
            DIM_P=triton.next_power_of_2(dim),
            ROWS=MERGE_ROWS,
            WRITE_LSE=lse is not None,
        )

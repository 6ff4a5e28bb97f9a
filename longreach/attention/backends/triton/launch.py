"""Launching the fused Triton kernel (:mod:`.kernel`) for the ``triton`` backend (:mod:`..triton`) and a compiled
decoding step (:mod:`...compiled_step`): the cells as the kernel reads them (:class:`Slot`), its grid of query tiles
and key splits (:class:`Grid`; Dao et al. 2023, "Flash-Decoding"), one launch (:func:`launch`, also the
``torch.library`` operator :data:`key_splits`) and the splits' merge by log-sum-exp (:func:`_combine`). Defined where
Triton is installed."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ...rotary import compute_dtype
from . import kernel

try:
    import triton
    from torch.library import triton_op, wrap_triton
except ImportError:  # pragma: no cover - depends on the installed packages
    triton = None

MAX_CELLS = 3  # DCA's three parts; every other method has one or two
# A cell without an upper distance bound. int32's largest: a Python int above it breaks Inductor's code for a
# user-defined kernel in torch 2.11 (``expr_fits_within_32bit`` asks a shape environment for a plain int's hint).
NO_BOUND = (1 << 31) - 1


@dataclass(frozen=True)
class Slot:
    """A cell as the kernel reads it: distances ``lo <= d < hi`` (``hi`` None: unbounded), keys turned by angle
    table ``table`` (None: as cached), and whether a key span limits it (its row of ``first``/``stop``)."""

    lo: int
    hi: int | None
    table: int | None = None
    spanned: bool = False


def parts_attention(
    queries: list[torch.Tensor],
    key: torch.Tensor,
    value: torch.Tensor,
    cells: list[Slot],
    scaling: float,
    offset: int,
    padding: torch.Tensor | None = None,
    tables: tuple[torch.Tensor, torch.Tensor] | None = None,
    spans: tuple[torch.Tensor, torch.Tensor] | None = None,
    key_positions: torch.Tensor | None = None,
    q_positions: torch.Tensor | None = None,
    splits: int | None = None,
    launcher=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of cell ``c``'s query ``queries[c] [B, Hq, Lq, D]`` over ``key``/``value [B, Hkv, Lkv, D]``.

    Query row ``t`` is at key index ``t + offset``; with ``q_positions [B, Lq]`` distances are those of the
    positions instead, ``q_positions - key_positions`` (``[B, Lkv]``), and every key is read (a static cache's
    slots, in any order). ``padding [B, Lkv]`` is False at padding keys. ``tables``: ``(cos, sin)`` ``[T, B, Lkv,
    P]`` (``P`` rotary pairs; dimensions past ``2P`` do not rotate), the angles a cell's keys turn by. ``spans``:
    ``(first [C, B, Lq], stop [C, B, Lq])``, key positions. ``splits``: programs per row along the keys (default:
    one for prefill, enough to fill the device for a decoding step). ``launcher``: :func:`launch` (default), or the
    operator :data:`key_splits` in a compiled graph. Returns ``(out [B, Hq, Lq, Dv], lse [B, Hq, Lq])`` in
    float32 (float64 for float64 inputs); rows with no key get 0 and ``-inf``.
    """
    if not 1 <= len(cells) <= MAX_CELLS or len(queries) != len(cells):
        raise ValueError(
            f"the fused kernel takes 1 to {MAX_CELLS} cells with one query each, got {len(cells)} cells, "
            f"{len(queries)} queries"
        )
    if key.device.type == "cpu" and key.dtype == torch.bfloat16:  # Triton's interpreter (3.9) multiplies bfloat16
        key, value = key.float(), value.float()  # wrongly
    bounds = [bound for c in cells for bound in (c.lo, NO_BOUND if c.hi is None else c.hi)]
    first, stop = (None, None) if spans is None else spans
    cos, sin = (None, None) if tables is None else tables
    out, lse = (launcher or launch)(
        torch.stack(queries).to(key.dtype),
        key,
        value,
        bounds,
        [-1 if c.table is None else c.table for c in cells],
        [c.spanned for c in cells],
        scaling,
        offset,
        splits or 0,
        padding,
        cos,
        sin,
        first,
        stop,
        key_positions,
        q_positions,
    )
    return _combine(out, lse)


def launch(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bounds: list[int],
    tables: list[int],
    spanned: list[bool],
    scaling: float,
    offset: int,
    splits: int = 0,
    padding: torch.Tensor | None = None,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    first: torch.Tensor | None = None,
    stop: torch.Tensor | None = None,
    key_positions: torch.Tensor | None = None,
    q_positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch of the kernel: every split's ``(out [S, B, Hq, Lq, Dv], lse [S, B, Hq, Lq])`` for the cells'
    queries ``query [C, B, Hq, Lq, D]``; cell ``c`` holds the distances ``bounds[2c] <= d < bounds[2c + 1]``, turns
    its keys by table ``tables[c]`` (-1: as cached) and is limited by its key span where ``spanned[c]``;
    ``splits``: key splits per row (0: enough to fill the device). Everything the positions decide arrives as a
    device tensor or a host number: nothing is uploaded, so a compiled decoding step captures it whole (as the
    ``torch.library`` operator :data:`key_splits`)."""
    cells = len(spanned)
    batch, q_heads, q_len, dim = query.shape[1:]
    kv_heads, kv_len, value_dim = key.shape[1], key.shape[2], value.shape[-1]
    group = q_heads // kv_heads
    accumulate = compute_dtype(key.dtype)
    key, value = _unit_stride(key), _unit_stride(value)
    pairs = dim // 2 if cos is None else cos.shape[-1]
    dummy = torch.empty(1, dtype=accumulate, device=key.device)  # never read (its flag is off): no launch to fill it
    if cos is None:
        cos = sin = dummy
    else:
        assert sin is not None  # given with cos
        cos, sin = cos.to(accumulate).contiguous(), sin.to(accumulate).contiguous()
    if first is None:
        first = stop = dummy
    else:
        assert stop is not None  # given with first
        first, stop = first.contiguous(), stop.contiguous()
    key_positions = dummy if key_positions is None else key_positions.contiguous()
    q_positions = dummy if q_positions is None else q_positions.contiguous()
    valid = dummy if padding is None else padding.to(torch.int8).contiguous()
    los, his = bounds[0::2] + [0] * (MAX_CELLS - cells), bounds[1::2] + [0] * (MAX_CELLS - cells)
    lo_min = min(bounds[0::2])
    hi_max = max(bounds[1::2])

    grid = Grid.of(key.device, batch, kv_heads, group * q_len, kv_len, splits)
    out = torch.empty(grid.splits, batch, q_heads, q_len, value_dim, dtype=accumulate, device=key.device)
    lse = torch.empty(grid.splits, batch, q_heads, q_len, dtype=accumulate, device=key.device)
    table_of = tables + [-1] * (MAX_CELLS - cells)
    spanned = spanned + [False] * (MAX_CELLS - cells)
    _traceable(kernel.longreach_fused)[(grid.m_tiles, batch * kv_heads, grid.splits)](
        query,
        key,
        value,
        cos,
        sin,
        valid,
        first,
        stop,
        key_positions,
        q_positions,
        out,
        lse,
        *query.stride()[:4],
        *key.stride()[:3],
        *value.stride()[:3],
        *(cos.stride()[:3] if cos is not dummy else (0, 0, 0)),
        *(first.stride()[:2] if first is not dummy else (0, 0)),
        valid.stride(0) if valid is not dummy else 0,
        key_positions.stride(0) if key_positions is not dummy else 0,
        q_positions.stride(0) if q_positions is not dummy else 0,
        *out.stride()[:4],
        *lse.stride()[:3],
        kv_heads,
        group,
        q_len,
        kv_len,
        offset,
        grid.keys_per_split,
        los[0],
        his[0],
        los[1],
        his[1],
        los[2],
        his[2],
        lo_min,
        hi_max,
        PAIRS=pairs,
        PAIRS_P=_pow2(pairs),
        REST=dim - 2 * pairs,
        REST_P=_pow2(dim - 2 * pairs),
        VALUE=value_dim,
        VALUE_P=_pow2(value_dim),
        CELLS=cells,
        TABLE0=table_of[0],
        TABLE1=table_of[1],
        TABLE2=table_of[2],
        SPAN0=spanned[0],
        SPAN1=spanned[1],
        SPAN2=spanned[2],
        PADDED=padding is not None,
        BY_POSITION=q_positions is not dummy,
        BOUNDED=hi_max < NO_BOUND,
        BLOCK_M=grid.block_m,
        BLOCK_N=grid.block_n,
        SCALE=scaling,
        F64=accumulate == torch.float64,
    )
    return out, lse


def _traceable(jit_kernel):
    """``wrap_triton(jit_kernel)``, which a compiled graph traces; the kernel itself where PyTorch cannot wrap it (torch
    2.7 refuses Triton's interpreted kernels: the CPU tests, whose compiled graphs run the operator as it is)."""
    try:
        return wrap_triton(jit_kernel)
    except RuntimeError:
        return jit_kernel


def _combine(out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The splits' outputs ``[S, ...]`` weighted by their share of each row's softmax, ``softmax_s(lse_s)`` (a row
    no split reached: NaN weights, set to 0): four operations."""
    if out.shape[0] == 1:
        return out[0], lse[0]
    weights = torch.softmax(lse, dim=0).nan_to_num_(nan=0.0)
    return torch.einsum("s...,s...d->...d", weights, out), torch.logsumexp(lse, dim=0)


if triton is not None:
    key_splits = triton_op("longreach::key_splits", launch, mutates_args=())
    """:func:`launch` as an operator: Inductor calls the kernel inside a compiled graph (and a CUDA graph)."""

    if os.environ.get("TRITON_INTERPRET") == "1":  # the interpreter runs kernels on fake tensors: their shapes instead

        @key_splits.register_fake  # type: ignore[attr-defined]  # a CustomOpDef, which torch types as a Callable
        def _(query, key, value, bounds, tables, spanned, scaling, offset, splits=0, *tensors):
            batch, q_heads, q_len = query.shape[1:4]
            grid = Grid.of(key.device, batch, key.shape[1], q_heads // key.shape[1] * q_len, key.shape[2], splits)
            out = query.new_empty(grid.splits, batch, q_heads, q_len, value.shape[-1], dtype=compute_dtype(key.dtype))
            return out, out.new_empty(out.shape[:-1])


def _unit_stride(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _pow2(n: int) -> int:
    """``n`` rounded up to a power of two, at least 16 (the smallest side of Triton's ``tl.dot``); 0 stays 0."""
    return 0 if n == 0 else max(16, triton.next_power_of_2(n))


@dataclass(frozen=True)
class Grid:
    """The launch's programs: query tiles of ``block_m`` rows (a group's heads packed), key tiles of ``block_n``, and
    ``splits`` programs per query tile along the keys, ``keys_per_split`` keys each (Flash-Decoding)."""

    block_m: int
    block_n: int
    m_tiles: int
    splits: int
    keys_per_split: int

    @staticmethod
    def of(device: torch.device, batch: int, kv_heads: int, rows: int, kv_len: int, splits: int) -> Grid:
        """Small query tiles for a decoding step's few ``rows``, 64 otherwise; ``splits`` (0: :func:`_splits`)."""
        block_m, block_n = (16 if rows <= 16 else (32 if rows <= 32 else 64)), 64
        m_tiles = triton.cdiv(rows, block_m)
        splits = splits or _splits(device, batch * kv_heads * m_tiles, kv_len, block_n)
        keys_per_split = triton.cdiv(triton.cdiv(kv_len, splits), block_n) * block_n
        return Grid(block_m, block_n, m_tiles, triton.cdiv(kv_len, keys_per_split), keys_per_split)


def _splits(device: torch.device, programs: int, kv_len: int, block_n: int) -> int:
    """Key splits per query tile: enough programs for two per streaming multiprocessor (one on the CPU's
    interpreter, four when there is one program per row anyway, to exercise the combine), none below a tile."""
    if device.type == "cuda":
        target = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    else:
        target = 4 * programs if programs <= 4 else programs
    return max(1, min(triton.cdiv(kv_len, block_n), triton.cdiv(target, programs)))

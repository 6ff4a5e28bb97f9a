"""``cuda_cudnn``: a method's cells as whole-block causal calls of cuDNN's attention, the kernel SDPA itself runs on
an H100 or H200 (docs/performance.md).

FlashAttention-2, FlexAttention and Triton kernels are each at least about 1.4x slower than cuDNN's attention on
those GPUs, so only calls of cuDNN can come near SDPA. Every cell given by distance alone is covered by blocks
that need no mask (:func:`...plan.blocks` with a band's tile as wide as the band): a band ``lo <= d < hi`` is, per
chunk of ``hi - lo - 1`` rows, one causal square and the square above it run causal on rows and keys reversed
(plus an unmasked rectangle where a chunk is short); an unbounded region is one causal square and one
rectangle. STRING is about ``2n / S + 2`` calls (9 at ``S = n / 3``; end-aligned chunks of ``S`` rows would make
it 6), and the work equals causal attention's. Each call is
``aten._scaled_dot_product_cudnn_attention`` with its log-sum-exp. Around the calls, two Triton kernels
(:mod:`.kernels`): one launch turns a cell's moved queries or keys, and the blocks merge by log-sum-exp in
one pass per row, straight into the model's dtype and ``[B, L, H, D]`` layout, which the kernel returns without a
copy (without Triton 3.3: the tiled kernel's rotation and merge, :mod:`...merge`). The plan depends on the positions
alone, so a forward pass makes it once.

DCA's cells, limited by key spans, are read from their spans on the host once per pass (:func:`...plan.span_blocks`):
per chunk of ``c`` rows a causal square (the same chunk), a rectangle (the previous chunk) and a rectangle (the
earlier ones), about ``3n / c`` calls, the work of causal attention.

It declines (the call goes to the next backend ``auto`` would take, with one warning per reason) what would need
a mask or a gradient: key padding, DPE's per-head pairs, bands narrower than a tile, a chunk whose band meets the
first key, key spans at positions other than the keys' indices, autograd; and a decoding step. Grouped key/value
heads go to cuDNN as they are; where it refuses them (once per process), they are repeated per query head.
"""

from __future__ import annotations

import warnings

import torch

from ...call import Call
from ...cells import Cell
from ...heads import expand_heads
from ...plan import MIN_BAND_TILE, SMALL_QUERY, Block, band_clipped, span_blocks
from ...rotary import compute_dtype
from ...views import angles, moved_keys
from .. import triton as triton_backend
from ..tiled import TiledBackend
from . import kernels
from .kernels import Piece

_failure: list[str] = []  # why cuDNN's attention failed in this process, once it has
_reasons_declined: set[str] = set()  # the kinds of call handed on so far, each said once
_grouped_heads_refused: list[bool] = []  # cuDNN's attention refused grouped key/value heads in this process
_kernels_failed: list[str] = []  # why the Triton rotation and merge failed to compile here, once they have


def _declined(reason: str) -> None:
    """Say that the call is handed on, once per ``reason`` in this process (the caller returns ``None``)."""
    if reason not in _reasons_declined:
        _reasons_declined.add(reason)
        warnings.warn(
            f"longreach: cuda_cudnn cannot take {reason} without a mask; such calls go to the next backend "
            "(slower, the same results)",
            stacklevel=6,
        )


class CudnnError(RuntimeError):
    """cuDNN's attention refused or failed a call (a shape, a head dim or a GPU it has no plan for)."""


def available(query: torch.Tensor, for_auto: bool = False) -> bool:
    """Whether cuDNN's attention takes ``query``: CUDA with cuDNN, float16 or bfloat16, head dim <= 128 (``for_auto``:
    and it has not failed in this process)."""
    if for_auto and _failure:
        return False
    return (
        query.device.type == "cuda"
        and torch.backends.cudnn.is_available()
        and query.dtype in (torch.float16, torch.bfloat16)
        and query.shape[-1] <= 128
    )


def cudnn_forward(q, k, v, causal: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``aten._scaled_dot_product_cudnn_attention`` on ``[B, H, L, D]`` tensors (top-left causal on a square):
    ``(out [B, H, Lq, D], lse [B, H, Lq])``."""
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False, scale=scaling
    )[:2]
    return out, lse.reshape(q.shape[:3])


class CudaCudnn(TiledBackend):
    name = "cuda_cudnn"
    summary = "cuDNN's attention on whole-block causal calls, no mask (CUDA prefill, half precision, forward only)"
    model_devices = ("cuda",)

    def unavailable(self, query) -> str | None:
        if available(query):
            return None
        return (
            "backend='cuda_cudnn' needs cuDNN's attention: a CUDA device with cuDNN, float16 or bfloat16 inputs "
            f"(head dim <= 128); got {query.device.type} {str(query.dtype).removeprefix('torch.')}"
        )

    def wants(self, query, fusable) -> bool:
        return query.shape[2] > SMALL_QUERY and available(query, for_auto=True)

    def compile_failed(self, error) -> bool:
        return isinstance(error, CudnnError)

    def give_up(self, error) -> None:
        if not _failure:
            _failure.append(str(error).splitlines()[0] if str(error) else type(error).__name__)
            warnings.warn(
                f"longreach: cuDNN's attention failed ({_failure[0]}); backend='auto' uses the next backend from now "
                "on (slower, the same results)",
                stacklevel=3,
            )

    def block(self, q, k, v, mask, causal, scaling):
        out, lse = self.attend(q, k, v, causal, scaling)
        return out.float(), lse.float()

    def attend(self, q, k, v, causal: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
        """One call of cuDNN's attention: ``(out [B, Hq, T, D]`` in the input dtype, ``lse [B, Hq, T])``. Grouped
        key/value heads go as they are until cuDNN refuses them once in this process; then, and from then on, they
        are repeated per query head."""
        if k.shape[1] != q.shape[1] and not _grouped_heads_refused:
            try:
                return cudnn_forward(q, k, v, causal, scaling)
            except torch.OutOfMemoryError:
                raise
            except RuntimeError:
                _grouped_heads_refused.append(True)
        k, v = expand_heads(k, q.shape[1]), expand_heads(v, q.shape[1])  # [B, Hq, K, D]
        try:
            return cudnn_forward(q, k, v, causal, scaling)
        except RuntimeError as error:
            raise CudnnError(
                f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error) else ''}"
            ) from error

    def tile(self, call: Call) -> int:
        """As tall as the call: a band's tile is then the band's own width (:func:`...plan.blocks`)."""
        return max(call.q_len, call.kv_len)

    def prepare(self, cells: tuple[Cell, ...], call: Call) -> list[list[Block]] | None:
        """Each cell's whole blocks, or ``None`` where a block would need a mask (decided by host arithmetic before
        any block is made) or autograd would differentiate the call: a prefill declined says why, once per reason
        in a process (a decoding step is never cuDNN's)."""
        if call.q_len <= SMALL_QUERY:
            return None
        reason = _needs_mask(cells, call)
        if reason is not None:
            _declined(reason)
            return None
        plans = [self.plan(cell, call, 0) if cell.part.key_span is None else _spanned(cell, call) for cell in cells]
        whole = [plan for plan in plans if plan is not None]
        return whole if len(whole) == len(plans) else None

    def run(self, plans: list[list[Block]], cells: tuple[Cell, ...], call: Call) -> tuple[torch.Tensor, torch.Tensor]:
        """Every block one call of cuDNN's attention on queries and keys moved by :func:`.kernels.rotated`,
        merged by :func:`.kernels.merge_into`: ``(out, lse)``, ``out`` a ``[B, Hq, Lq, Dv]`` view of a
        ``[B, Lq, Hq, Dv]`` tensor in the query's dtype (the layout and dtype :func:`...kernel.attention` returns)."""
        if not kernels.FUSED or _kernels_failed:
            return super().run(plans, cells, call)
        try:
            return self._run_fused(plans, cells, call)
        except Exception as error:
            if not triton_backend.compile_failed(error):
                raise
            _kernels_failed.append(f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
            warnings.warn(
                f"longreach: cuda_cudnn's Triton kernels failed to compile ({_kernels_failed[0]}); its blocks are "
                "turned and merged by torch operations from now on (slower, the same results)",
                stacklevel=4,
            )
            return super().run(plans, cells, call)

    def _run_fused(self, plans, cells, call) -> tuple[torch.Tensor, torch.Tensor]:
        pieces = []
        keys: dict[int, torch.Tensor] = {}  # moved keys by key shift
        for cell, plan in zip(cells, plans, strict=True):
            if not plan:  # no pair of the cell here: nothing to move
                continue
            part = cell.part
            q = _moved(call.query, angles(call, "query", part.query_shift, call.q_positions))  # [B, Hq, Lq, D]
            if (k := keys.get(id(part.key_shift))) is None:
                k = keys[id(part.key_shift)] = (  # [B, Hkv, Lkv, D]
                    moved_keys(call, part.key_shift)  # kept across decoding steps
                    if call.kept_keys is not None
                    else _moved(call.key, angles(call, "key", part.key_shift, call.positions))
                )
            pieces += [self.piece(b, q, k, call.value, call.scaling) for b in plan]
        batch, heads, q_len = call.query.shape[:3]
        out = call.query.new_empty(batch, q_len, heads, call.value.shape[-1])
        lse = torch.empty(batch, heads, q_len, dtype=compute_dtype(call.query.dtype), device=call.query.device)
        kernels.merge_into(pieces, out, lse)
        return out.transpose(1, 2), lse

    def piece(self, b: Block, q, k, v, scaling: float) -> Piece:
        """One block of the plan, one call (a flipped block: causal on the rows and keys reversed, its result left
        reversed for the merge to read)."""
        q, k, v = q[:, :, b.rows], k[:, :, b.keys], v[:, :, b.keys]  # [B, Hq, T, D], [B, Hkv, K, D], [B, Hkv, K, Dv]
        if b.flipped:
            q, k, v = q.flip(2), k.flip(2), v.flip(2)
        out, lse = self.attend(q, k, v, b.causal or b.flipped, scaling)
        return Piece(out, lse, b.rows.start, reversed=b.flipped)


def _needs_mask(cells: tuple[Cell, ...], call: Call) -> str | None:
    """Why some block of a prefill would need a mask or autograd would differentiate it (host arithmetic before any
    block is made, key spans aside: :func:`_spanned`), or ``None``."""
    if call.needs_grad:
        return "gradients"
    if call.key_padding is not None:
        return "key padding (a padded batch)"
    if any(cell.part.pairs is not None for cell in cells):
        return "DPE's per-head rotary pairs"
    for cell in cells:
        if cell.part.key_span is not None or cell.hi is None:
            continue
        band = cell.hi - cell.lo - 1  # the band's tile
        if band < MIN_BAND_TILE:
            return f"a band narrower than {MIN_BAND_TILE} keys"
        if band_clipped(call.q_len, cell.lo, cell.hi, call.offset, band):
            return "a chunk of queries whose band meets the first key"
    return None


def _spanned(cell: Cell, call: Call) -> list[Block] | None:
    """A cell limited by key spans (DCA) as whole blocks (:func:`...plan.span_blocks`), its spans read on the host
    once per pass; ``None`` (with a warning) where the keys' positions are not their indices (a batch whose
    positions differ) or a block would need a mask."""
    indices = torch.arange(call.kv_len, device=call.positions.device)
    if not torch.equal(call.positions, indices.expand_as(call.positions)):
        _declined("key spans at positions other than the keys' indices")
        return None
    span = cell.span(call.q_positions)
    assert span is not None  # a cell limited by key spans
    first, stop = (bound.expand(call.batch, call.q_len)[0].cpu() for bound in span)
    found = span_blocks(first, stop, cell.lo, cell.hi, call.offset, call.kv_len)
    if found is None:
        _declined("key spans that are not whole blocks")
    return found


def _moved(x: torch.Tensor, shift_angles: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """``x`` turned by a shift's ``(cos, sin)`` in one launch, or as it is (no shift)."""
    return x if shift_angles is None else kernels.rotated(x, *shift_angles)


BACKEND = CudaCudnn()

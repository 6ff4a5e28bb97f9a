"""``triton``: every cell of a method in one Triton kernel: one pass over the keys, one softmax per row.

A method's parts are disjoint regions of the causal pairs, each with its own view of q and k; lowered, they are
the kernel's *cells* (:mod:`...cells`): cell ``c`` scores its pairs
``lo_c <= i - j < hi_c`` (and, for DCA, key positions in ``[first_c(i), stop_c(i))``) as ``q_c . k_c``, and all
cells meet in one online softmax (Dao et al. 2022, FlashAttention, Algorithm 1) -- no log-sum-exp merge. The
cell's query ``q_c`` is moved on the host (a query is one row per token); its keys are the cached keys,
either as they are or turned inside the kernel by per-key angles (``cos``, ``sin`` tables of the part's key
shift, :data:`...shifts.KEY_ROTATIONS`): the cache is read once, never copied or rotated in memory. A tile of
keys a cell cannot reach (tile arithmetic on distances) skips that cell's dot product, so a STRING or
ReRoPE tile costs one matrix product except in the band where the parts meet.

Decoding splits the keys between programs (Dao et al. 2023, "Flash-Decoding"): each writes its part's output and
log-sum-exp, and the splits merge (:mod:`.launch`, which launches the kernel, written in :mod:`.kernel`). A query
tile packs the rows of every query head that shares a key/value head (grouped-query attention reads each key once per
group). What the positions decide (moved queries, key angle tables, key spans) is laid out once per forward pass
(:func:`lay_out`); the cells' distance bounds are scalar arguments, so a launch uploads nothing. A compiled decoding
step calls the kernel as the operator :data:`.launch.key_splits` (``torch.library.triton_op``), with distances taken
from the slots' positions on the device (:mod:`...compiled_step`), so that a CUDA graph captures it.

Runs compiled on CUDA, and on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``, set before
Triton is imported), which the tests use; there bfloat16 inputs are computed in float32 (the interpreter's
``tl.dot`` gets bfloat16 wrong). Forward only: gradients take the tiled kernel.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import torch

from ...call import Call
from ...cells import Cell, key_views, query_views, view_angles
from ...plan import SMALL_QUERY
from ...rotary import apply_rotation, compute_dtype
from ...views import angles
from ..base import Backend
from .launch import MAX_CELLS, Slot, parts_attention

try:
    import triton
except ImportError:  # pragma: no cover - depends on the installed packages
    triton = None

_compile_failure: list[str] = []  # why compiling the kernel failed in this process, once it has


def available(device: torch.device | str, for_auto: bool = False) -> bool:
    """Whether the kernel can run on ``device``: Triton is installed, and the device is CUDA, or the CPU
    under Triton's interpreter (``TRITON_INTERPRET=1``); ``for_auto``: and compiling it has not failed here."""
    if triton is None or (for_auto and _compile_failure):
        return False
    kind = torch.device(device).type
    return kind == "cuda" or (kind == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


def takes(dtype: torch.dtype) -> bool:
    """Whether the kernel compiles for ``dtype``: ``tl.dot`` takes float64 from Triton 3.5 on (torch 2.9's
    Triton); float32, float16 and bfloat16 from every release we support."""
    if dtype != torch.float64:
        return True
    major, minor = (int(part) for part in triton.__version__.split(".")[:2])
    return (major, minor) >= (3, 5)


def takes_compiled_step(query: torch.Tensor, cells) -> bool:
    """Whether a compiled decoding step calls the kernel (:func:`...compiled_step.attention`): Triton on the query's
    device and dtype, and cells it takes -- at most :data:`MAX_CELLS`, none with per-head pairs (DPE)."""
    return (
        available(query.device, for_auto=True)
        and takes(query.dtype)
        and 1 <= len(cells) <= MAX_CELLS
        and all(cell.part.pairs is None for cell in cells)
    )


def compile_failed(error: BaseException) -> bool:
    """Whether ``error`` is Triton failing to compile or launch the kernel (an old GPU, too little shared memory)."""
    if triton is None:
        return False
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    return isinstance(error, (CompilationError, OutOfResources))


def give_up(error: BaseException) -> None:
    """Stop choosing the kernel for ``auto`` in this process, with one warning that says why."""
    if not _compile_failure:
        _compile_failure.append(f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
        warnings.warn(
            f"longreach: the fused Triton kernel failed ({_compile_failure[0]}); backend='auto' decodes with the "
            "tiled kernel from now on (slower, the same results)",
            stacklevel=3,
        )


@dataclass(frozen=True, eq=False)
class Layout:
    """What a forward pass's positions decide: each cell's query view (0: the query as it is, ``v``: moved by
    ``angles[v - 1]``, ``(cos, sin) [V, B, 1, Lq, P]``), the angles ``(cos, sin) [T, B, Lkv, P]`` of the per-token
    key shifts the kernel turns keys by, and the key spans ``(first, stop) [C, B, Lq]``."""

    slots: list[Slot]
    view_of: list[int]
    angles: tuple[torch.Tensor, torch.Tensor] | None
    tables: tuple[torch.Tensor, torch.Tensor] | None
    spans: tuple[torch.Tensor, torch.Tensor] | None


class Triton(Backend):
    name = "triton"
    summary = "every cell in one fused Triton kernel, split along the keys for decoding; forward only (CUDA)"
    folds_block_key_shifts = False  # the kernel turns the keys by their own angles

    def model_problem(self, device: str) -> str | None:
        if device == "meta" or available(device):
            return None
        return (
            "backend='triton' needs Triton and a model on a CUDA device (or TRITON_INTERPRET=1 on the CPU); "
            f"this model is on {device!r}"
        )

    def unavailable(self, query) -> str | None:
        if not available(query.device):
            return (
                f"backend='triton' needs Triton on a CUDA device, or TRITON_INTERPRET=1 on the CPU; "
                f"not available on {query.device}"
            )
        if not takes(query.dtype):
            return (
                f"backend='triton' with float64 inputs needs Triton >= 3.5 (its tl.dot takes no float64 before; "
                f"{triton.__version__} is installed): give float32, or use backend='auto'"
            )
        return None

    def refuses(self, query, fusable, needs_grad) -> str | None:
        if not fusable:
            return "backend='triton' computes no gradients and no per-head rotary pairs (DPE): use backend='auto' here"
        return None

    def wants(self, query, fusable) -> bool:
        return (
            query.device.type == "cuda"
            and query.shape[2] <= SMALL_QUERY
            and fusable
            and available(query.device, for_auto=True)
        )

    def compile_failed(self, error) -> bool:
        return compile_failed(error)

    def give_up(self, error) -> None:
        give_up(error)

    def prepare(self, cells: tuple[Cell, ...], call: Call) -> Layout:
        compute = compute_dtype(call.query.dtype)
        return lay_out(
            cells, call.q_positions, call.inv_freq, compute, lambda shift: angles(call, "key", shift, call.positions)
        )

    def run(self, layout: Layout, cells: tuple[Cell, ...], call: Call) -> tuple[torch.Tensor, torch.Tensor]:
        return parts_attention(
            cell_queries(layout, call.query),
            call.key,
            call.value,
            layout.slots,
            call.scaling,
            call.offset,
            call.key_padding,
            layout.tables,
            layout.spans,
            call.positions if layout.spans is not None else None,
        )


def lay_out(cells: tuple[Cell, ...], q_positions: torch.Tensor, inv_freq: torch.Tensor, dtype, key_angles) -> Layout:
    """What the positions decide, once per forward pass: a cell's query is moved by its query shift less a constant
    key shift (:func:`...cells.query_views`); a per-token key shift is turned inside the kernel by the angles
    ``key_angles(shift)`` ``(cos, sin) [B, 1, Lkv, P]``, stacked here, not in every layer; DCA's key spans."""
    views, view_of = query_views(cells)
    shifts, key_of = key_views(cells)
    slots = [
        Slot(cell.lo, cell.hi, None if table == 0 else table - 1, cell.part.key_span is not None)
        for cell, table in zip(cells, key_of, strict=True)
    ]
    moved = view_angles(views, q_positions, inv_freq, dtype) if views else None
    spans = None
    if any(cell.part.key_span is not None for cell in cells):
        everything = torch.iinfo(torch.int64)
        every = [torch.full_like(q_positions, bound, dtype=torch.int64) for bound in (everything.min, everything.max)]
        bounds = []
        for cell in cells:
            span = cell.span(q_positions)
            bounds.append(every if span is None else [b.expand_as(q_positions) for b in span])
        first, stop = [torch.stack([bound[side] for bound in bounds]) for side in (0, 1)]  # [C, B, Lq] each
        spans = (first, stop)
    tables = None
    if shifts:
        turns = [key_angles(shift) for shift in shifts]
        cos, sin = [torch.stack([turn[side][:, 0] for turn in turns]) for side in (0, 1)]  # [T, B, Lkv, P] each
        tables = (cos, sin)
    return Layout(slots, view_of, moved, tables, spans)


def cell_queries(layout: Layout, query: torch.Tensor) -> list[torch.Tensor]:
    """Each cell's query ``[B, Hq, Lq, D]``: the query as it is, or its view moved by the layout's angles."""
    moved = [] if layout.angles is None else list(apply_rotation(query[None], *layout.angles))
    return [query if view == 0 else moved[view - 1] for view in layout.view_of]


BACKEND = Triton()

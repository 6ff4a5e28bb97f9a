"""``triton``: every cell of a method in one Triton kernel: one pass over the keys, one softmax per row.

A method's parts are disjoint regions of the causal pairs, each with its own view of q and k; lowered, they are
the kernel's *cells* (:mod:`..cells`): cell ``c`` scores its pairs
``lo_c <= i - j < hi_c`` (and, for DCA, key positions in ``[first_c(i), stop_c(i))``) as ``q_c . k_c``, and all
cells meet in one online softmax (Dao et al. 2022, FlashAttention, Algorithm 1) -- no log-sum-exp merge. The
cell's query ``q_c`` is moved on the host (a query is one row per token); its keys are the cached keys,
either as they are or turned inside the kernel by per-key angles (``cos``, ``sin`` tables of the part's key
shift, :data:`.shifts.KEY_ROTATIONS`): the cache is read once, never copied or rotated in memory. A tile of
keys a cell cannot reach (tile arithmetic on distances) skips that cell's dot product, so a STRING or
ReRoPE tile costs one matrix product except in the band where the parts meet.

Decoding splits the keys between programs (Dao et al. 2023, "Flash-Decoding"): each writes its part's
output and log-sum-exp, and :func:`_combine` merges the splits. A query tile packs the rows of every query
head that shares a key/value head (grouped-query attention reads each key once per group). What the positions
decide (moved queries, key angle tables, key spans) is laid out once per forward pass (:func:`lay_out`); the
cells' distance bounds are scalar arguments, so a launch uploads nothing. A compiled decoding step calls the
kernel as the operator :data:`key_splits` (``torch.library.triton_op``), with distances taken from the slots'
positions on the device (:mod:`..static`), so that a CUDA graph captures it.

Runs compiled on CUDA, and on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``, set before
Triton is imported), which the tests use; there bfloat16 inputs are computed in float32 (the interpreter's
``tl.dot`` gets bfloat16 wrong). Forward only: gradients take the tiled kernel.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import torch

from .. import triton_kernel
from ..call import Call
from ..cells import Cell, key_views, query_views, view_angles
from ..plan import SMALL_QUERY
from ..rotary import apply_rotation, compute_dtype
from ..views import angles
from .base import Backend

try:
    import triton
    from torch.library import triton_op, wrap_triton
except ImportError:  # pragma: no cover - depends on the installed packages
    triton = None

MAX_CELLS = 3  # DCA's three parts; every other method has one or two
NO_BOUND = 1 << 62  # a cell without an upper distance bound


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
    """Whether a compiled decoding step calls the kernel (:func:`..static.attention`): Triton on the query's device
    and dtype, and cells it takes -- at most :data:`MAX_CELLS`, none with per-head pairs (DPE)."""
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
    cos, sin = (dummy, dummy) if cos is None else (cos.to(accumulate).contiguous(), sin.to(accumulate).contiguous())
    first, stop = (dummy, dummy) if first is None else (first.contiguous(), stop.contiguous())
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
    _traceable(triton_kernel.longreach_fused)[(grid.m_tiles, batch * kv_heads, grid.splits)](
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


def _traceable(kernel):
    """``wrap_triton(kernel)``, which a compiled graph traces; the kernel itself where PyTorch cannot wrap it (torch
    2.7 refuses Triton's interpreted kernels: the CPU tests, whose compiled graphs run the operator as it is)."""
    try:
        return wrap_triton(kernel)
    except RuntimeError:
        return kernel


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

        @key_splits.register_fake
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
    key shift (:func:`..cells.query_views`); a per-token key shift is turned inside the kernel by the angles
    ``key_angles(shift)`` ``(cos, sin) [B, 1, Lkv, P]``, stacked here, not in every layer; DCA's key spans."""
    views, view_of = query_views(cells)
    shifts, key_of = key_views(cells)
    slots = [
        Slot(cell.lo, cell.hi, None if table == 0 else table - 1, cell.part.key_span is not None)
        for cell, table in zip(cells, key_of)
    ]
    moved = view_angles(views, q_positions, inv_freq, dtype) if views else None
    spans = None
    if any(cell.part.key_span is not None for cell in cells):
        everything = torch.iinfo(torch.int64)
        every = [torch.full_like(q_positions, bound, dtype=torch.int64) for bound in (everything.min, everything.max)]
        bounds = [
            every if cell.part.key_span is None else [b.expand_as(q_positions) for b in cell.span(q_positions)]
            for cell in cells
        ]
        spans = tuple(torch.stack([bound[side] for bound in bounds]) for side in (0, 1))  # [C, B, Lq] each
    tables = None
    if shifts:
        turns = [key_angles(shift) for shift in shifts]
        tables = tuple(torch.stack([turn[side][:, 0] for turn in turns]) for side in (0, 1))  # [T, B, Lkv, P] each
    return Layout(slots, view_of, moved, tables, spans)


def cell_queries(layout: Layout, query: torch.Tensor) -> list[torch.Tensor]:
    """Each cell's query ``[B, Hq, Lq, D]``: the query as it is, or its view moved by the layout's angles."""
    moved = [] if layout.angles is None else list(apply_rotation(query[None], *layout.angles))
    return [query if view == 0 else moved[view - 1] for view in layout.view_of]


BACKEND = Triton()

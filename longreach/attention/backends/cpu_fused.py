"""``cpu_fused``: every cell of a method in one pass on the CPU, a C++ kernel built on first use (``csrc/parts.cpp``).

PyTorch's CPU flash attention skips work in 256 x 512 tiles, so each causal edge of a call wastes about
256 keys per row: STRING's band and far triangle have three edges where causal attention has one, and the
tiled kernel (:mod:`..plan`) cannot go below about 1.1x causal SDPA at 8K. This kernel takes every part
as a *cell* -- a query view, a key view and distance bounds ``lo <= i - j < hi`` -- in one online softmax
per row (Dao et al. 2022, FlashAttention, Algorithm 1): no log-sum-exp merge, no flipped copies, and the keys a
distance bound or a key span (DCA) cuts are taken 32 at a time with only the rows that reach them. Each cell has its own
query, so STRING's far part is the query moved back by ``S - W`` against the keys as they are, and no key is copied.
A decoding step packs the query heads that share a key/value head into one tile: each key is read once.

The kernel is built on first use, with the machine's C++ compiler, and called by :mod:`..native`, which a paged cache
(:mod:`..paged`) calls too; here each sequence's keys are one block. Inputs are computed in float32. Where it cannot be
built or loaded (no compiler, a BLAS without ``sgemm_``), ``auto`` uses the tiled kernel from then on, with one warning.
"""

from __future__ import annotations

import functools
import os
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import native
from ..call import Call
from ..cells import Cell, key_views, query_views, view_angles
from ..plan import first_real_keys, key_position_offsets
from ..rotary import apply_rotation, compute_dtype
from ..views import moved_keys
from .base import Backend

_build_failure: list[str] = []  # why building the kernel failed in this process, once it has


def available(device: torch.device | str, for_auto: bool = False) -> bool:
    """Whether the kernel can run on ``device``: the CPU, with a C++ compiler (``for_auto``: and building it has
    not failed in this process)."""
    if torch.device(device).type != "cpu" or (for_auto and _build_failure):
        return False
    return _compiler() is not None


@functools.cache
def _compiler() -> str | None:
    """The C++ compiler torch would build with (``CXX``, else ``c++``), or ``None``."""
    return shutil.which(os.environ.get("CXX", "c++"))


def compile_failed(error: BaseException) -> bool:
    """Whether ``error`` is the kernel failing to build or load."""
    return isinstance(error, native.BuildError)


def give_up(error: BaseException) -> None:
    """Stop choosing the kernel for ``auto`` in this process, with one warning that says why."""
    if not _build_failure:
        _build_failure.append(str(error).splitlines()[0] if str(error) else type(error).__name__)
        warnings.warn(
            f"longreach: the CPU attention kernel could not be built ({_build_failure[0]}); backend='auto' uses the "
            "tiled kernel from now on (slower, the same results)",
            stacklevel=3,
        )


def ensure_built() -> bool:
    """The kernel built, or found built, in this process now (its one "building" line), rather than in a first call
    that is timed, or in a vLLM worker; where it cannot be, ``auto`` gives it up with one warning (:func:`give_up`).
    Returns whether it is built."""
    if not available("cpu", for_auto=True):
        return False
    try:
        native.extension()
    except native.BuildError as error:
        give_up(error)
        return False
    return True


class CpuFused(Backend):
    name = "cpu_fused"
    summary = "every cell in one pass of a C++ kernel built on first use (CPU, forward only)"
    model_devices = ("cpu", "meta")
    fallback = "cpu_flash"

    def unavailable(self, query) -> str | None:
        if available(query.device):
            return None
        return (
            f"backend='cpu_fused' needs a CPU tensor and a C++ compiler (CXX or c++ on PATH); got {query.device.type}"
        )

    def refuses(self, query, fusable, needs_grad) -> str | None:
        if not fusable:
            return (
                "backend='cpu_fused' computes no gradients and no per-head rotary pairs (DPE): use backend='auto' here"
            )
        return None

    def wants(self, query, fusable) -> bool:
        # under torch.compile the tiled kernel, which Dynamo traces (the C++ call would break the graph)
        return (
            query.device.type == "cpu"
            and fusable
            and not torch.compiler.is_compiling()
            and available(query.device, for_auto=True)
        )

    def compile_failed(self, error) -> bool:
        return compile_failed(error)

    def give_up(self, error) -> None:
        give_up(error)

    def prepare(self, cells: tuple[Cell, ...], call: Call) -> Layout | None:
        """The cells' layout, or ``None`` (to the tiled kernel) for padding other than on the left, or key spans over
        positions that are not consecutive (packed documents)."""
        return Layout.of(cells, call)

    def run(self, layout: Layout, cells: tuple[Cell, ...], call: Call) -> tuple[torch.Tensor, torch.Tensor]:
        """As in the Triton kernel (:mod:`.triton`), a cell's query is moved by its query shift less a constant key
        shift (a row per query: a decoding step moves one, where moving the keys would turn the whole cache); DCA's
        key shift, constant per chunk, is folded into one query per chunk in decoding. A layer rotates its query
        views in one call; keys moved by a per-token shift are kept across decoding steps where asked."""
        query = call.query
        queries = (
            [query] if layout.angles is None else [query, *apply_rotation(query[None], *layout.angles)]
        )  # V x [B, Hq, Lq, D]
        keys = [call.key, *(moved_keys(call, shift) for shift in layout.key_shifts)]  # [B, Hkv, Lkv, D] each
        return parts_attention(queries, keys, call.value, layout, call.scaling, call.offset)


@dataclass(frozen=True)
class Layout:
    """A forward pass's cells as the kernel reads them (:func:`..native.cell_table`): ``table [cells, 5]`` over the
    query views ``[query, *moved by angles]`` and the key views ``[key, *moved by key_shifts]``; each span's first and
    stop key index ``[B, Lq]``; each sequence's first real key ``[B]``."""

    table: torch.Tensor
    angles: tuple[torch.Tensor, torch.Tensor] | None  # (cos, sin) [V, B, 1, Lq, P] of the moved query views
    key_shifts: list[Callable]
    span_first: list[torch.Tensor]
    span_stop: list[torch.Tensor]
    first_key: torch.Tensor

    @classmethod
    def of(cls, cells: tuple[Cell, ...], call: Call) -> Layout | None:
        positions, key_padding = call.positions, call.key_padding
        batch, kv_len, q_len = call.batch, call.kv_len, call.q_len
        first_key = torch.zeros(batch, dtype=torch.int64) if key_padding is None else first_real_keys(key_padding)
        if first_key is None:
            return None
        spanned = any(cell.part.key_span is not None for cell in cells)
        offsets = key_position_offsets(positions, first_key) if spanned else None
        if spanned and offsets is None:
            return None
        views, view_of = query_views(cells)
        key_shifts, key_of = key_views(cells)
        table, span_first, span_stop = native.cell_table(
            cells, view_of, key_of, call.q_positions, lambda span: _key_indices(span, offsets, kv_len, batch, q_len)
        )
        compute = compute_dtype(call.query.dtype)
        angles = view_angles(views, call.q_positions, call.inv_freq, compute) if views else None
        return cls(table, angles, key_shifts, span_first, span_stop, first_key.to(torch.int64).contiguous())


def _key_indices(
    span, offsets: torch.Tensor | None, kv_len: int, batch: int, q_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A span of key positions ``(first, stop)`` as key indices in ``[0, Lkv]``, ``[B, Lq]`` each (``offsets [B]``: each
    sequence's position of key 0), clamped before the subtraction: DCA's "every position" is int64's least."""
    assert offsets is not None  # found wherever a cell has a key span (Layout.of declines the call otherwise)
    first_position = offsets[:, None]
    return tuple(
        (bound.clamp(first_position - kv_len, first_position + 2 * kv_len) - first_position)
        .clamp(0, kv_len)
        .to(torch.int64)
        .expand(batch, q_len)
        .contiguous()
        for bound in span
    )


def parts_attention(
    queries: list[torch.Tensor],
    keys: list[torch.Tensor],
    value: torch.Tensor,
    layout: Layout,
    scaling: float,
    offset: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel on query views ``[B, Hq, Lq, D]`` and key views ``[B, Hkv, Lkv, D]`` as ``layout`` lays them out;
    query row ``t`` is key index ``t + offset``. Returns ``(out [B, Hq, Lq, Dv], lse [B, Hq, Lq])`` in float32; a row
    with no key is 0 with ``lse = -inf``. Each sequence is one block of the kernel's planes (:mod:`..paged` reads a
    paged cache)."""
    batch, q_heads, q_len, _ = queries[0].shape
    kv_len = value.shape[2]

    def as_input(x):
        return x if x.dtype == torch.float32 and x.is_contiguous() else x.to(torch.float32).contiguous()

    sequences = torch.stack(
        [
            torch.arange(batch) * q_len,
            torch.full((batch,), q_len),
            torch.full((batch,), int(offset)),
            torch.full((batch,), kv_len),
            layout.first_key,
        ],
        dim=1,
    )
    no_angles = [torch.empty(0)] * len(keys)
    out, lse = native.parts_attention(
        [as_input(q.transpose(0, 1)).reshape(q_heads, batch * q_len, -1) for q in queries],
        [as_input(k) for k in keys],
        [False] * len(keys),
        no_angles,
        no_angles,
        as_input(value),
        torch.arange(batch)[:, None],
        max(kv_len, 1),
        sequences,
        layout.table,
        [first.reshape(-1) for first in layout.span_first],
        [stop.reshape(-1) for stop in layout.span_stop],
        scaling,
    )
    return out.view(q_heads, batch, q_len, -1).transpose(0, 1), lse.view(q_heads, batch, q_len).transpose(0, 1)


BACKEND = CpuFused()

"""Every part of a method in one pass on the CPU: a C++ kernel built on first use (``csrc/parts.cpp``).

PyTorch's CPU flash attention skips work in 256 x 512 tiles, so each causal edge of a call wastes about
256 keys per row: STRING's band and far triangle have three edges where causal attention has one, and the
tiled kernel (:mod:`.plan`) cannot go below about 1.1x causal SDPA at 8K. This kernel takes every part
as a *cell* -- a query view, a key view and distance bounds ``lo <= i - j < hi`` -- in one online softmax
per row (Dao et al. 2022, FlashAttention, Algorithm 1): no log-sum-exp merge, no flipped copies, and the keys a
distance bound or a key span (DCA) cuts are taken 32 at a time with only the rows that reach them. Each cell has its own query, so
STRING's far part is the query moved back by ``S - W`` against the keys as they are, and no key is copied.
A decoding step packs the query heads that share a key/value head into one tile: each key is read once.

Built by ``torch.utils.cpp_extension`` with the machine's C++ compiler (about 25 seconds on 2 cores, once per
machine, PyTorch release and source; ``TORCH_EXTENSIONS_DIR`` says where). Inputs are computed in float32. Where it cannot be built or loaded (no compiler, a BLAS
without ``sgemm_``), ``auto`` uses the tiled kernel from then on, with one warning.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from . import build_lock
from .plan import SMALL_QUERY, first_real_keys, key_position_offsets, upper_bound
from .rotary import apply_rotation, compute_dtype, rotation
from .shifts import fold_block_key_shifts, shift_angles

SOURCE = Path(__file__).with_name("csrc") / "parts.cpp"


class BuildError(RuntimeError):
    """The kernel could not be compiled or loaded on this machine."""


_build_failure: list[str] = []  # why building the kernel failed in this process, once it has


def available(device: torch.device | str, for_auto: bool = False) -> bool:
    """Whether the kernel can run on ``device``: the CPU, with a C++ compiler (``for_auto``: and building it has
    not failed in this process)."""
    if torch.device(device).type != "cpu" or (for_auto and _build_failure):
        return False
    return _compiler() is not None


@functools.lru_cache(maxsize=None)
def _compiler() -> str | None:
    """The C++ compiler torch would build with (``CXX``, else ``c++``), or ``None``."""
    return shutil.which(os.environ.get("CXX", "c++"))


def compile_failed(error: BaseException) -> bool:
    """Whether ``error`` is the kernel failing to build or load."""
    return isinstance(error, BuildError)


def give_up(error: BaseException) -> None:
    """Stop choosing the kernel for ``auto`` in this process, with one warning that says why."""
    if not _build_failure:
        _build_failure.append(str(error).splitlines()[0] if str(error) else type(error).__name__)
        warnings.warn(f"longreach: the CPU attention kernel could not be built ({_build_failure[0]}); backend='auto' uses the "
                      "tiled kernel from now on (slower, the same results)", stacklevel=3)


def attention(query, key, value, parts, inv_freq, scaling, sliding_window, positions, key_padding, memo, geometry,
              moved_keys: Callable[[Callable], torch.Tensor]) -> torch.Tensor | None:
    """Every part in one pass of the kernel: ``[B, Hq, Lq, Dv]`` in float32, or ``None`` where it does not apply
    (padding other than on the left; key spans over positions that are not consecutive). ``moved_keys(shift)``: the
    keys moved by a per-token key shift (the caller keeps them across decoding steps where asked).

    As in the Triton kernel (:mod:`.fused`), a part's query is moved by its query shift less a constant key shift (a
    row per query: a decoding step moves one, where moving the keys would turn the whole cache); DCA's key shift,
    constant per chunk, is folded into one query per chunk in decoding (:func:`.shifts.fold_block_key_shifts`). What
    depends on positions alone -- the views, their angles, the cell table, the spans as key indices -- is laid out
    once per forward pass (``memo``); a layer rotates its query views in one call."""
    objects = (parts, positions) if key_padding is None else (parts, positions, key_padding)
    layout = memo.get("native layout", objects, (*geometry, sliding_window),
                      lambda: Layout.of(parts, sliding_window, positions, key_padding, query.shape[2], inv_freq, compute_dtype(query.dtype)))
    if layout is None:
        return None
    if layout.table.shape[0] == 0:  # the model's sliding window excludes every part
        return torch.zeros(*query.shape[:3], value.shape[-1], dtype=torch.float32, device=query.device)
    queries = [query] if layout.angles is None else [query, *apply_rotation(query[None], *layout.angles)]
    keys = [key, *(moved_keys(shift) for shift in layout.key_shifts)]
    out, _ = parts_attention(queries, keys, value, layout, scaling, key.shape[2] - query.shape[2])
    return out


@dataclass(frozen=True)
class Layout:
    """A forward pass's cells: ``table [cells, 5]`` (query view, key view, lo, hi or -1, span or -1) over the query
    views ``[query, *moved by angles]`` and the key views ``[key, *moved by key_shifts]``; each span's first and stop
    key index ``[B, Lq]``; each sequence's first real key ``[B]``."""

    table: torch.Tensor
    angles: tuple[torch.Tensor, torch.Tensor] | None  # (cos, sin) [V, B, 1, Lq, P] of the moved query views
    key_shifts: list[Callable]
    span_first: list[torch.Tensor]
    span_stop: list[torch.Tensor]
    first_key: torch.Tensor

    @classmethod
    def of(cls, parts, sliding_window, positions, key_padding, q_len, inv_freq, dtype) -> "Layout | None":
        batch, kv_len = positions.shape[0], positions.shape[-1]
        first_key = torch.zeros(batch, dtype=torch.int64) if key_padding is None else first_real_keys(key_padding)
        if first_key is None:
            return None
        if q_len <= SMALL_QUERY:
            parts = fold_block_key_shifts(parts, positions)
        spanned = any(part.key_span is not None for part in parts)
        offsets = key_position_offsets(positions, first_key) if spanned else None
        if spanned and offsets is None:
            return None
        q_positions = positions[:, kv_len - q_len:]
        views, key_shifts, rows, spans = [], [], [], []  # views: (query shift, constant key shift) of the moved queries
        for part in parts:
            lo, hi = part.min_distance, upper_bound(part, sliding_window)
            if hi is not None and hi <= lo:
                continue
            moving_key = callable(part.key_shift)
            key_constant = 0.0 if moving_key else float(part.key_shift)
            view = (part.query_shift, key_constant)
            if not callable(part.query_shift) and part.query_shift == key_constant:
                query_view = 0
            else:
                views += [] if view in views else [view]
                query_view = 1 + views.index(view)
            if moving_key and part.key_shift not in key_shifts:
                key_shifts.append(part.key_shift)
            key_view = 1 + key_shifts.index(part.key_shift) if moving_key else 0
            span = -1
            if part.key_span is not None:
                spans.append(_key_indices(part.key_span(q_positions), offsets, kv_len, batch, q_len))
                span = len(spans) - 1
            rows.append((query_view, key_view, lo, -1 if hi is None else hi, span))
        table = torch.tensor(rows, dtype=torch.int64).reshape(-1, 5)
        angles = _view_angles(views, q_positions, inv_freq, dtype) if views else None
        return cls(table, angles, key_shifts, [first for first, _ in spans], [stop for _, stop in spans], first_key.to(torch.int64).contiguous())


def _view_angles(views, q_positions, inv_freq, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` ``[V, B, 1, Lq, P]`` of each query view's move: its query shift less its constant key shift."""
    batch, q_len = q_positions.shape
    angles = []
    for shift, key_constant in views:
        if callable(shift):
            angles.append(shift_angles(lambda p, shift=shift, by=key_constant: shift(p) - by, q_positions, inv_freq, dtype))
        else:
            angles.append(rotation(shift - key_constant, inv_freq, dtype, q_positions.device))
    shape = (batch, 1, q_len, inv_freq.shape[-1])
    return tuple(torch.stack([angle[side].expand(shape) for angle in angles]) for side in (0, 1))


def _key_indices(span, offsets: torch.Tensor, kv_len: int, batch: int, q_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A span of key positions ``(first, stop)`` as key indices in ``[0, Lkv]``, ``[B, Lq]`` each (``offsets [B]``: each
    sequence's position of key 0), clamped before the subtraction: DCA's "every position" is int64's least."""
    first_position = offsets[:, None]
    return tuple((bound.clamp(first_position - kv_len, first_position + 2 * kv_len) - first_position).clamp(0, kv_len)
                 .to(torch.int64).expand(batch, q_len).contiguous() for bound in span)


def parts_attention(queries: list[torch.Tensor], keys: list[torch.Tensor], value: torch.Tensor, layout: Layout, scaling: float,
                    offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel on query views ``[B, Hq, Lq, D]`` and key views ``[B, Hkv, Lkv, D]`` as ``layout`` lays them out;
    query row ``t`` is key index ``t + offset``. Returns ``(out [B, Hq, Lq, Dv], lse [B, Hq, Lq])`` in float32; a row
    with no key is 0 with ``lse = -inf``."""
    as_input = lambda x: x if x.dtype == torch.float32 and x.is_contiguous() else x.to(torch.float32).contiguous()
    return _module().parts_attention([as_input(q) for q in queries], [as_input(k) for k in keys], as_input(value), layout.table,
                                     layout.span_first, layout.span_stop, layout.first_key, int(offset), float(scaling))


@functools.lru_cache(maxsize=None)
def _module():
    """The compiled extension, built once per machine, Python and PyTorch release and source (its name holds their hash),
    in ``TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``), under a lock that names its builder
    (:mod:`.build_lock`: a build killed midway does not block the next)."""
    from torch.utils import cpp_extension

    flags = _flags()
    folder = _build_folder()
    path = os.environ.get("PATH", "")
    try:
        # torch runs ninja by name: the one pip installed beside this Python counts too
        os.environ["PATH"] = os.pathsep.join([path, os.path.dirname(sys.executable)])
        with build_lock.holding(folder):
            if not (folder / f"{folder.name}.so").exists():
                print(f"longreach: building the CPU attention kernel once (about 25 s on 2 cores) in {folder}", file=sys.stderr, flush=True)
            return cpp_extension.load(name=folder.name, sources=[str(SOURCE)], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                                      build_directory=str(folder), verbose=False)
    except (OSError, RuntimeError, ImportError, SystemExit, subprocess.SubprocessError) as error:  # a compiler that fails its version check
        raise BuildError(f"{type(error).__name__}: {str(error).strip().splitlines()[-1] if str(error).strip() else ''}") from error
    finally:
        os.environ["PATH"] = path


def _flags() -> list[str]:
    """The compiler flags: -O3, OpenMP, and PyTorch's vector types in their AVX2 form where the CPU has AVX2."""
    flags = ["-O3", "-fopenmp"]
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        flags += ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2"]
    return flags


def _build_folder() -> Path:
    """Where the kernel is built: ``TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``), then a name that
    holds a hash of the source, the PyTorch and Python releases and the flags."""
    from torch.utils import cpp_extension

    digest = hashlib.sha256("\n".join([SOURCE.read_text(), torch.__version__, sys.implementation.cache_tag, *_flags()]).encode())
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    return Path(root) / f"longreach_parts_{digest.hexdigest()[:12]}"

"""The FlexAttention backend: one ``flex_attention`` call per part (Dong et al. 2024, "Flex Attention:
A Programming Model for Generating Optimized Attention Kernels", arXiv:2412.05496).

A part's region -- the pairs ``lo <= i - j < hi`` (``hi`` already cut by the model's sliding
window), DCA's key spans, and key padding -- is one predicate, :meth:`Region.allowed`: the ``mask_mod``
FlexAttention evaluates inside the tiles the region covers only in part. Which 128 x 128 tiles are
empty, full or partial comes from tile arithmetic (each tile's distance range, its keys' padding and
positions), O(tiles^2), never a pass over the pairs (``create_block_mask`` evaluates every pair).
Grouped-query attention is native (``enable_gqa``), and the log-sum-exp comes back for the kernel's
merge of the parts.

Compiled with ``torch.compile`` on CUDA. On CPU, PyTorch runs FlexAttention eagerly, computing the
full scores matrix, and has no backward there: this path exists on CPU so that the whole backend is
checked against the dense reference in CI at small sizes; ``auto`` never picks it on CPU.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from dataclasses import dataclass

import torch

from .. import compat
from .rotary import compute_dtype

try:  # PyTorch >= 2.5
    from torch.nn.attention import flex_attention as _flex_module
except ImportError:  # pragma: no cover - depends on the installed PyTorch
    _flex_module = None

TILE = 128  # FlexAttention's default sparse block size
INT32 = torch.iinfo(torch.int32)


_compile_failure: list[str] = []  # why compiling FlexAttention failed in this process, once it has


def compile_failed(error: BaseException) -> bool:
    """Whether ``error`` is PyTorch failing to compile FlexAttention (TorchDynamo, Inductor, a C++ or CUDA compiler)."""
    from torch._dynamo.exc import TorchDynamoException

    failures = (TorchDynamoException,)
    try:
        from torch._inductor import exc as inductor

        failures += tuple(getattr(inductor, name) for name in ("InductorError", "CppCompileError", "CUDACompileError") if hasattr(inductor, name))
    except ImportError:  # pragma: no cover - depends on the installed PyTorch
        pass
    return isinstance(error, failures)


def give_up(error: BaseException) -> None:
    """Stop choosing FlexAttention for ``auto`` in this process, with one warning that says why."""
    if not _compile_failure:
        _compile_failure.append(f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
        warnings.warn(f"longreach: compiling FlexAttention failed ({_compile_failure[0]}); backend='auto' uses the tiled kernel "
                      "from now on (slower on GPUs, the same results)", stacklevel=3)


def available(device: torch.device | str, for_auto: bool = False) -> bool:
    """Whether FlexAttention can run on ``device``: PyTorch has it, and on CUDA Triton is installed to compile it
    (``for_auto``: and compiling it has not failed in this process)."""
    if _flex_module is None or (for_auto and _compile_failure):
        return False
    if torch.device(device).type != "cuda":
        return True
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass(frozen=True, eq=False)
class Region:
    """The pairs of one part: query row ``t`` is at index ``i = t + offset`` of the ``Lkv`` keys.

    ``padding [B, Lkv]`` is False at padding keys; ``span = (first, stop, key_positions)`` keeps the
    pairs whose key position lies in ``[first[b, t], stop[b, t])`` (``first``, ``stop``: ``[B, Lq]``).
    """

    lo: int | torch.Tensor  # int bounds; 0-d tensors inside the compiled mask (see _block_mask)
    hi: int | torch.Tensor | None
    offset: int | torch.Tensor
    padding: torch.Tensor | None = None
    span: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def allowed(self, b: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        """Whether the pairs ``(b, q_idx, kv_idx)`` (broadcastable integer tensors) are in the region."""
        distance = q_idx + self.offset - kv_idx
        inside = distance >= self.lo
        if self.hi is not None:
            inside = inside & (distance < self.hi)
        if self.padding is not None:
            inside = inside & self.padding[b, kv_idx]
        if self.span is not None:
            first, stop, key_positions = self.span
            key = key_positions[b, kv_idx]
            inside = inside & (key >= first[b, q_idx]) & (key < stop[b, q_idx])
        return inside

    def block_mask(self, batch: int, q_len: int, kv_len: int, device) -> "_flex_module.BlockMask":
        """The region as a FlexAttention block mask (one for the whole batch when nothing depends on the sequence)."""
        if self.padding is None and self.span is None:
            return _structured_block_mask(self.lo, self.hi, self.offset, q_len, kv_len, str(device))
        return _block_mask(self, batch, q_len, kv_len, device)


@functools.lru_cache(maxsize=64)
def _structured_block_mask(lo, hi, offset, q_len, kv_len, device):
    """Distance bounds only: the same block mask serves every layer and sequence, so it is built once."""
    return _block_mask(Region(lo, hi, offset), 1, q_len, kv_len, device)


def _block_mask(region: Region, batch: int, q_len: int, kv_len: int, device):
    """The region's block mask: its tiles sorted by :func:`_tile_classes`, its pairs by :meth:`Region.allowed`."""
    partial, full = _tile_classes(region, q_len, kv_len, device)
    # the compiled kernel sees the bounds as tensors: new values (a decoding step's offset) reuse it, not recompile it
    as_tensor = lambda x: None if x is None else torch.tensor(min(max(x, INT32.min), INT32.max), dtype=torch.int32, device=device)
    span = None if region.span is None else tuple(map(_int32, region.span))
    traced = dataclasses.replace(region, lo=as_tensor(region.lo), hi=as_tensor(region.hi), offset=as_tensor(region.offset), span=span)

    def mask_mod(b, h, q_idx, kv_idx):
        return traced.allowed(b, q_idx, kv_idx)

    return _flex_module.BlockMask.from_kv_blocks(
        *_tile_lists(partial), *_tile_lists(full), BLOCK_SIZE=TILE, mask_mod=mask_mod, seq_lengths=(q_len, kv_len)
    )


def _tile_classes(region: Region, q_len: int, kv_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(partial, full)`` ``[B, 1, q tiles, kv tiles]``: the 128 x 128 tiles sorted by tile arithmetic, O(tiles^2)
    work, no pair scanned.

    A tile's distances lie in ``[q_first + offset - k_last, q_last + offset - k_first]``; it is empty when that
    range misses ``[lo, hi)``, full when it lies inside (a tile cut short by the sequence's end stays partial).
    Padding counts per key tile (no real key: empty; some: partial). A key span (DCA) compares the key tile's
    lowest and highest position with the query tile's widest and narrowest span. Every bound is conservative,
    so a tile classed empty holds no allowed pair and a full one no other: partial tiles are masked pair by
    pair by ``mask_mod`` (:meth:`Region.allowed`), which decides exactly.
    """
    q_tiles, kv_tiles = -(-q_len // TILE), -(-kv_len // TILE)
    q_first = torch.arange(q_tiles, device=device) * TILE
    q_last = torch.clamp(q_first + TILE - 1, max=q_len - 1)
    k_first = torch.arange(kv_tiles, device=device) * TILE
    k_last = torch.clamp(k_first + TILE - 1, max=kv_len - 1)
    whole = ((q_last - q_first + 1 == TILE)[:, None] & (k_last - k_first + 1 == TILE)[None, :])[None]  # [1, Q, K]
    closest = (q_first[:, None] + region.offset - k_last[None, :])[None]  # the tile's smallest distance
    farthest = (q_last[:, None] + region.offset - k_first[None, :])[None]
    any_pair, all_pairs = farthest >= region.lo, (closest >= region.lo) & whole
    if region.hi is not None:
        any_pair, all_pairs = any_pair & (closest < region.hi), all_pairs & (farthest < region.hi)
    if region.padding is not None:
        real = _per_tile(region.padding, kv_tiles)  # [B, K, TILE]
        any_pair, all_pairs = any_pair & real.any(-1)[:, None], all_pairs & real.all(-1)[:, None]
    if region.span is not None:
        first, stop, key_positions = region.span
        first, stop = _per_tile(first, q_tiles), _per_tile(stop, q_tiles)  # [B, Q, TILE]
        keys = _per_tile(key_positions, kv_tiles)
        lowest, highest = keys.amin(-1)[:, None, :], keys.amax(-1)[:, None, :]  # [B, 1, K]
        any_pair = any_pair & (highest >= first.amin(-1)[..., None]) & (lowest < stop.amax(-1)[..., None])
        all_pairs = all_pairs & (lowest >= first.amax(-1)[..., None]) & (highest < stop.amin(-1)[..., None])
    batch = max(any_pair.shape[0], all_pairs.shape[0])
    return (any_pair & ~all_pairs).expand(batch, -1, -1)[:, None], all_pairs.expand(batch, -1, -1)[:, None]


def segment_length(length: int) -> int:
    """Rows or keys per segment of :func:`segmented_block_mask`: ``length`` rounded up to whole tiles."""
    return -(-length // TILE) * TILE


def segmented_block_mask(cells: list[tuple[int, int, Region]], q_segments: int, kv_segments: int, q_len: int, kv_len: int,
                         device) -> "_flex_module.BlockMask":
    """One block mask over queries and keys laid side by side in tile-aligned segments (``segment_length`` rows or
    keys each): cell ``(a, c, region)`` gives query segment ``a`` against key segment ``c`` the pairs of ``region``
    (row ``a s_q + t`` is query ``t`` as a part moves it, key ``c s_k + j`` key ``j``); pairs of no cell are out.
    The regions share ``offset`` and ``padding``. With one query segment the parts meet in one softmax (the log-sum-exp
    merge of docs/how-it-works.md, in one call); with several, each query segment's rows are merged by log-sum-exp."""
    q_segment, kv_segment = segment_length(q_len), segment_length(kv_len)
    q_tiles, kv_tiles = q_segment // TILE, kv_segment // TILE
    classes = [(a, c, *_tile_classes(region, q_len, kv_len, device)) for a, c, region in cells]
    batch = max(partial.shape[0] for *_, partial, _ in classes)
    partial = torch.zeros(batch, 1, q_segments * q_tiles, kv_segments * kv_tiles, dtype=torch.bool, device=device)
    full = torch.zeros_like(partial)
    table = torch.full((q_segments, kv_segments), -1, dtype=torch.int32, device=device)
    for index, (a, c, cell_partial, cell_full) in enumerate(classes):
        rows, keys = slice(a * q_tiles, (a + 1) * q_tiles), slice(c * kv_tiles, (c + 1) * kv_tiles)
        partial[:, :, rows, keys], full[:, :, rows, keys] = cell_partial, cell_full
        table[a, c] = index
    regions = [region for *_, region in cells]
    lows = torch.tensor([r.lo for r in regions], dtype=torch.int32, device=device)
    highs = torch.tensor([INT32.max if r.hi is None else min(r.hi, INT32.max) for r in regions], dtype=torch.int32, device=device)
    sizes = {name: torch.tensor(value, dtype=torch.int32, device=device) for name, value in
             (("q_segment", q_segment), ("kv_segment", kv_segment), ("q_len", q_len), ("kv_len", kv_len), ("offset", regions[0].offset))}
    padding = regions[0].padding
    spans = _stacked_spans(regions, batch, q_len)

    def mask_mod(b, h, q_idx, kv_idx):
        a, c = q_idx // sizes["q_segment"], kv_idx // sizes["kv_segment"]
        row, key = q_idx - a * sizes["q_segment"], kv_idx - c * sizes["kv_segment"]
        cell = table[a, c]
        part = torch.clamp(cell, min=0)
        row_at, key_at = torch.clamp(row, max=sizes["q_len"] - 1), torch.clamp(key, max=sizes["kv_len"] - 1)
        distance = row + sizes["offset"] - key
        inside = (cell >= 0) & (row < sizes["q_len"]) & (key < sizes["kv_len"]) & (distance >= lows[part]) & (distance < highs[part])
        if padding is not None:
            inside = inside & padding[b, key_at]
        if spans is not None:
            first, stop, key_positions = spans
            position = key_positions[b, key_at]
            inside = inside & (position >= first[part, b, row_at]) & (position < stop[part, b, row_at])
        return inside

    return _flex_module.BlockMask.from_kv_blocks(*_tile_lists(partial), *_tile_lists(full), BLOCK_SIZE=TILE, mask_mod=mask_mod,
                                                 seq_lengths=(q_segments * q_segment, kv_segments * kv_segment))


def _stacked_spans(regions: list[Region], batch: int, q_len: int):
    """The regions' key spans as ``(first [parts, B, Lq], stop [parts, B, Lq], key positions [B, Lkv])`` (a region
    without one: every position), or ``None`` when no region has one."""
    spanned = [r.span for r in regions if r.span is not None]
    if not spanned:
        return None
    _, _, key_positions = spanned[0]
    first = torch.stack([_int32(r.span[0]).expand(batch, q_len) if r.span is not None else
                         torch.full((batch, q_len), INT32.min, dtype=torch.int32, device=key_positions.device) for r in regions])
    stop = torch.stack([_int32(r.span[1]).expand(batch, q_len) if r.span is not None else
                        torch.full((batch, q_len), INT32.max, dtype=torch.int32, device=key_positions.device) for r in regions])
    return first, stop, _int32(key_positions)


def _int32(values: torch.Tensor) -> torch.Tensor:
    """Positions and bounds for a mask: int32 like FlexAttention's indices (int64 doubles the registers and shared
    memory the kernel's mask needs; bounds beyond int32 are clamped, positions never reach them)."""
    return values.clamp(INT32.min, INT32.max).to(torch.int32)


def _per_tile(values: torch.Tensor, tiles: int) -> torch.Tensor:
    """``values [B, L]`` as ``[B, tiles, TILE]``, the last tile filled with its last value (which it repeats
    only where the sequence ends: a repeated value changes no tile's minimum, maximum, any or all)."""
    padded = torch.cat((values, values[:, -1:].expand(-1, tiles * TILE - values.shape[-1])), dim=-1)
    return padded.view(values.shape[0], tiles, TILE)


def _tile_lists(selected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(count [B, 1, Q], indices [B, 1, Q, K])`` of the selected key tiles per query tile, the selected first."""
    count = selected.sum(-1, dtype=torch.int32)
    indices = torch.argsort(selected.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return count, indices


def part_attention(q, k, v, mask, causal, scaling):
    """One part: ``flex_attention`` with the part's block mask (``mask``), returning ``(out, lse)`` in float32
    (float64 for float64 inputs). ``causal`` is never set: the block mask holds the whole region.

    Where Triton finds no configuration that fits the GPU's shared memory (an H200 with the segmented masks of
    ReRoPE, Self-Extend and DCA: 528 KB asked, 227 KB there), the call is compiled again with each of
    :data:`SMALLER_TILES` in turn; the kernel variant keeps the tiles that worked, other variants keep theirs."""
    kwargs = {"block_mask": mask, "scale": scaling, "enable_gqa": q.shape[1] != k.shape[1]}
    variant = _variant(q, mask)
    while True:
        taken = _tiles_taken.get(variant, 0)
        try:
            out, lse = compat.flex_attention_with_lse(_function(q.device.type), _flex_module, q, k, v,
                                                      kernel_options=SMALLER_TILES[taken - 1] if taken else None, **kwargs)
            break
        except Exception as error:
            if taken == len(SMALLER_TILES) or "out of resource" not in str(error):
                raise
            _tiles_taken[variant] = taken + 1
    return out.to(compute_dtype(q.dtype)), lse.to(compute_dtype(q.dtype))


SMALLER_TILES = ({"num_stages": 1}, {"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 1}, {"BLOCK_M": 32, "BLOCK_N": 32, "num_stages": 1})
"""FlexAttention's ``kernel_options`` tried in turn when the default tiles need more shared memory than the GPU has
(fewer pipeline stages first: on an H200, 64 x 64 tiles made plain causal attention 1.6x slower than the default)."""
_tiles_taken: dict[tuple, int] = {}  # kernel variant (see _variant) -> how many of SMALLER_TILES it had to step through


def _variant(q: torch.Tensor, mask) -> tuple:
    """What decides a compiled kernel's shared memory: dtype, head size, the mask's code and what it reads (whether
    padding and key spans are there, the segments' table by its shape; per-token tensors not by their length)."""
    mod = mask.mask_mod

    def described(x):
        if isinstance(x, torch.Tensor):
            return tuple(x.shape) if x.numel() <= 64 else (x.dtype, x.dim())
        return None if x is None else type(x).__name__

    return q.device.type, q.dtype, q.shape[-1], mod.__code__, tuple(described(cell.cell_contents) for cell in mod.__closure__ or ())


RECOMPILE_LIMIT = 64
"""Compiled variants of ``flex_attention`` allowed per process (PyTorch's default, 8, is spent by a few methods at
a few lengths; past it PyTorch falls back to the eager version, which holds the whole scores matrix)."""


@functools.lru_cache(maxsize=None)
def _function(device_type: str):
    """Compiled ``flex_attention`` on CUDA; the eager one elsewhere (its warning about that, once, silenced)."""
    if device_type == "cuda":
        compiled = torch.compile(_flex_module.flex_attention)
        config = torch._dynamo.config

        def with_more_variants(*args, **kwargs):
            with config.patch(recompile_limit=max(RECOMPILE_LIMIT, config.recompile_limit)):
                return compiled(*args, **kwargs)

        return with_more_variants

    def eager(*args, **kwargs):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
            return _flex_module.flex_attention(*args, **kwargs)

    return eager

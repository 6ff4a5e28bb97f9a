"""FlexAttention's block masks for the cells (Dong et al. 2024, "Flex Attention", arXiv:2412.05496).

A cell's region -- the pairs ``lo <= i - j < hi`` (``hi`` already cut by the model's sliding window), DCA's key
spans, and key padding -- is one predicate, :meth:`Region.allowed` (the rule of :func:`...parts.covers`): the
``mask_mod`` FlexAttention evaluates inside the tiles the region covers only in part. Which 128 x 128 tiles are
empty, full or partial comes from tile arithmetic (each tile's distance range, its keys' padding and positions),
O(tiles^2), never a pass over the pairs (``create_block_mask`` evaluates every pair).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
from torch.nn.attention import flex_attention as _flex_module

from ...parts import covers

TILE = 128  # FlexAttention's default sparse block size
INT32 = torch.iinfo(torch.int32)


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
        real = None if self.padding is None else self.padding[b, kv_idx]
        if self.span is None:
            return covers(distance, self.lo, self.hi, real)
        first, stop, key_positions = self.span
        return covers(distance, self.lo, self.hi, real, key_positions[b, kv_idx], (first[b, q_idx], stop[b, q_idx]))

    def block_mask(self, batch: int, q_len: int, kv_len: int, device) -> _flex_module.BlockMask:
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
    def as_tensor(x):
        return None if x is None else torch.tensor(min(max(x, INT32.min), INT32.max), dtype=torch.int32, device=device)

    span = None
    if region.span is not None:
        first, stop, key_positions = region.span
        span = (_int32(first), _int32(stop), _int32(key_positions))
    traced = dataclasses.replace(
        region, lo=as_tensor(region.lo), hi=as_tensor(region.hi), offset=as_tensor(region.offset), span=span
    )

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


def segmented_block_mask(
    cells: list[tuple[int, int, Region]], q_segments: int, kv_segments: int, q_len: int, kv_len: int, device
) -> _flex_module.BlockMask:
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
    highs = torch.tensor(
        [INT32.max if r.hi is None else min(r.hi, INT32.max) for r in regions], dtype=torch.int32, device=device
    )
    sizes = {
        name: torch.tensor(value, dtype=torch.int32, device=device)
        for name, value in (
            ("q_segment", q_segment),
            ("kv_segment", kv_segment),
            ("q_len", q_len),
            ("kv_len", kv_len),
            ("offset", regions[0].offset),
        )
    }
    padding = regions[0].padding
    spans = _stacked_spans(regions, batch, q_len)

    def mask_mod(b, h, q_idx, kv_idx):
        a, c = q_idx // sizes["q_segment"], kv_idx // sizes["kv_segment"]
        row, key = q_idx - a * sizes["q_segment"], kv_idx - c * sizes["kv_segment"]
        cell = table[a, c]
        part = torch.clamp(cell, min=0)
        row_at, key_at = torch.clamp(row, max=sizes["q_len"] - 1), torch.clamp(key, max=sizes["kv_len"] - 1)
        distance = row + sizes["offset"] - key
        inside = (cell >= 0) & (row < sizes["q_len"]) & (key < sizes["kv_len"])
        real = None if padding is None else padding[b, key_at]
        if spans is None:
            return inside & covers(distance, lows[part], highs[part], real)
        first, stop, key_positions = spans
        span = (first[part, b, row_at], stop[part, b, row_at])
        inside = inside & covers(distance, lows[part], highs[part], real, key_positions[b, key_at], span)
        return inside

    return _flex_module.BlockMask.from_kv_blocks(
        *_tile_lists(partial),
        *_tile_lists(full),
        BLOCK_SIZE=TILE,
        mask_mod=mask_mod,
        seq_lengths=(q_segments * q_segment, kv_segments * kv_segment),
    )


def _stacked_spans(regions: list[Region], batch: int, q_len: int):
    """The regions' key spans as ``(first [parts, B, Lq], stop [parts, B, Lq], key positions [B, Lkv])`` (a region
    without one: every position), or ``None`` when no region has one."""
    spanned = [r.span for r in regions if r.span is not None]
    if not spanned:
        return None
    _, _, key_positions = spanned[0]
    first = torch.stack(
        [
            _int32(r.span[0]).expand(batch, q_len)
            if r.span is not None
            else torch.full((batch, q_len), INT32.min, dtype=torch.int32, device=key_positions.device)
            for r in regions
        ]
    )
    stop = torch.stack(
        [
            _int32(r.span[1]).expand(batch, q_len)
            if r.span is not None
            else torch.full((batch, q_len), INT32.max, dtype=torch.int32, device=key_positions.device)
            for r in regions
        ]
    )
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

"""Which calls cover a part: the tile plans of the kernel (docs/how-it-works.md).

A part's pairs ``lo <= i - j < hi`` are covered by :class:`Block` s, each one backend call: query rows
against a slice of keys, unmasked, top-left causal, or with a tile-sized additive mask. An unbounded
region is one causal call on a shifted square plus an unmasked rectangle (:func:`_unbounded`); a band is
three blocks per query tile (:func:`_band`); left padding adds masked tiles over the padded first keys only;
decoding, narrow bands and chunked regions (DCA) use query tiles against only the keys a tile can reach
(:func:`masked_tiles`). Memory is O(n): a region is never materialised as an n x n mask.

Queries are the last ``Lq`` of the ``Lkv`` keys, so query row ``t`` sits at index ``i = t + offset``.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import torch

from .parts import NEG_INF, covers

SMALL_QUERY = 16  # decoding and short chunks: one small masked tile is cheapest
MIN_BAND_TILE = 32  # narrower bands are computed with masked tiles
MAX_SPAN_BLOCKS = 1024  # a part's whole blocks from its key spans: beyond, they are tiles in all but name


class Block(NamedTuple):
    """One call of a backend: the query ``rows`` against the ``keys``, with an additive ``mask`` or a
    top-left ``causal`` mask (or neither); for the FlexAttention backend, ``mask`` is the part's block mask.
    ``flipped``: a square whose pairs are key ``u >= `` row ``t`` (the transpose of causal), run as a causal
    call on the rows and keys in reverse order (softmax does not depend on the order of the keys), so a
    backend skips the empty half as it does for causal blocks."""

    rows: slice
    keys: slice
    mask: object = None  # an additive mask tensor, a FlexAttention BlockMask, or None
    causal: bool = False
    flipped: bool = False


def blocks(q_len, kv_len, lo, hi, offset, key_padding, padded, span, tile, structured, dtype, device):
    """The calls that cover a part's pairs ``lo <= i - j < hi``. ``structured`` (a whole-blocks backend,
    no key span, more than a few queries): the padded first ``padded`` keys (:func:`padded_keys`) with
    masked tiles, the rest with the unmasked plan of an unbounded region or a wide band, as if no
    sequence were padded. Otherwise masked tiles (:func:`masked_tiles`)."""
    if not structured or (hi is not None and hi - lo - 1 < MIN_BAND_TILE):
        return masked_tiles(q_len, kv_len, lo, hi, offset, key_padding, padded, span, tile, dtype, device)
    prefix = (
        masked_tiles(q_len, padded, lo, hi, offset, key_padding, padded, None, tile, dtype, device) if padded else ()
    )
    if hi is None:
        return itertools.chain(prefix, _unbounded(q_len, lo, offset, padded))
    # bands use tiles twice as tall: fewer, larger unmasked calls beat the wasted diagonal halves (measured)
    band_tile = min(2 * tile, hi - lo - 1)
    return itertools.chain(prefix, _band(q_len, lo, hi, offset, band_tile, dtype, device, padded))


def band_clipped(q_len: int, lo: int, hi: int, offset: int, tile: int, first_key: int = 0) -> bool:
    """Whether :func:`_band`'s plan of ``lo <= i - j < hi`` in query tiles of ``tile`` meets an upper square cut by
    the first key, which takes a mask (host arithmetic only: no block is made)."""
    tops = (start + offset - hi + 1 for start in range(0, q_len, tile))
    return any(top < first_key < top + tile for top in tops)


def _unbounded(q_len, lo, offset, first_key=0):
    """Pairs with ``i - j >= lo`` and keys from ``first_key`` on, unpadded: one unmasked rectangle and
    one causal square.

    Query row ``t`` (``i = t + offset``) sees keys ``first_key <= j <= i - lo``. Rows from ``first`` on
    see something; keys below ``first + offset - lo`` are seen by all of them (rectangle), the rest form
    a square whose top-left-aligned causal mask is exactly the region.
    """
    first = max(0, first_key + lo - offset)
    if first >= q_len:
        return
    shared = first + offset - lo
    rows = slice(first, q_len)
    if shared > first_key:
        yield Block(rows, slice(first_key, shared))
    yield Block(rows, slice(shared, shared + (q_len - first)), causal=True)


def _band(q_len, lo, hi, offset, tile, dtype, device, first_key=0):
    """Pairs with ``lo <= i - j < hi`` and keys from ``first_key`` on, unpadded, ``tile <= hi - lo - 1``:
    three blocks per query tile.

    For the tile of ``R`` rows ``i in [a, a + R)`` the reachable keys ``(a - hi, a + R - lo)`` split into
    an upper square ``[a - hi + 1, +R)`` where the region is ``u >= t`` (a :attr:`Block.flipped` causal
    call), a middle block every row sees whole, and a lower block ``[a - lo, +R)`` where the region is
    top-left causal. Where the upper square is cut by the first key, it is a masked block (one constant
    T x T mask). Work is the band's own area; no n-sized mask.
    """
    upper = None  # the T x T mask of a clipped upper block, made when one is met
    for start in range(0, q_len, tile):
        stop = min(q_len, start + tile)
        a, rows, height = start + offset, slice(start, stop), stop - start
        top = a - hi + 1
        if top >= first_key:
            yield Block(rows, slice(top, top + height), flipped=True)
            middle_first = top + height
        else:
            if top + tile > first_key:  # upper block, clipped at the first key
                if upper is None:
                    outside = torch.ones(tile, tile, dtype=torch.bool, device=device).tril(-1)  # where u < t
                    upper = torch.zeros(outside.shape, dtype=dtype, device=device).masked_fill(outside, NEG_INF)
                yield Block(rows, slice(first_key, top + tile), upper[:height, first_key - top :])
            middle_first = top + tile
        middle = slice(max(first_key, middle_first), max(first_key, a - lo))
        if middle.stop > middle.start:
            yield Block(rows, middle)
        skip = max(0, first_key + lo - a)  # rows with i - lo < first_key see nothing in the lower block
        if skip < height:
            yield Block(slice(start + skip, stop), slice(a + skip - lo, a - lo + height), causal=True)


def span_blocks(first: torch.Tensor, stop: torch.Tensor, lo: int, hi: int | None, offset: int, kv_len: int):
    """Whole blocks for a part limited by key spans (DCA's chunks), or ``None`` where one would need a mask.

    ``first``, ``stop`` ``[Lq]`` (host): each query row's span of key indices (the keys' positions are their
    indices: no padding). Row ``t`` attends keys ``[a_t, b_t)``, the span cut by the distance bounds. A run of rows
    with the same ``a`` is one top-left causal square where ``b`` grows with the row from ``a + 1`` (from further: a
    rectangle of the keys before, then the square), else one unmasked rectangle per run of equal ``b`` (DCA: a
    causal square per chunk, a rectangle per chunk for the previous chunk and for the earlier ones); more than
    :data:`MAX_SPAN_BLOCKS` blocks would be tiles, not blocks."""
    rows = torch.arange(len(first)) + offset  # each row's key index
    a = first.clamp(min=0) if hi is None else torch.maximum(first, rows - hi + 1).clamp(min=0)
    b = torch.minimum(stop, rows - lo + 1).clamp(max=kv_len)
    empty = b <= a
    a, b = a.masked_fill(empty, -1), b.masked_fill(empty, -1)
    found = []
    for begin, end in _runs(a):
        key_start, key_stops = int(a[begin]), b[begin:end]
        if key_start < 0:  # rows with no key here
            continue
        diagonal = int(key_stops[0]) - 1  # the first row's last key
        if end - begin > 1 and bool((key_stops - rows[begin:end] == diagonal + 1 - rows[begin]).all()):
            if diagonal > key_start:  # a chunk of queries starting inside the span: the keys before it, unmasked
                found.append(Block(slice(begin, end), slice(key_start, diagonal)))
            found.append(Block(slice(begin, end), slice(diagonal, diagonal + end - begin), causal=True))
        else:
            stops = _runs(key_stops)
            if len(found) + len(stops) > MAX_SPAN_BLOCKS:
                return None
            found += [Block(slice(begin + i, begin + j), slice(key_start, int(key_stops[i]))) for i, j in stops]
    return found if len(found) <= MAX_SPAN_BLOCKS else None


def _runs(values: torch.Tensor) -> list[tuple[int, int]]:
    """``(begin, end)`` of each run of equal values."""
    starts = [0, *(torch.nonzero(values[1:] != values[:-1]).flatten() + 1).tolist(), len(values)]
    return list(itertools.pairwise(starts))


def masked_tiles(q_len, kv_len, lo, hi, offset, key_padding, padded, span, tile, dtype, device):
    """Pairs with ``lo <= i - j < hi`` (``hi=None``: unbounded), unpadded keys and, when ``span =
    (key_span, positions)`` is given, key positions in ``key_span(query positions)``; a mask per tile.

    The general path (key padding, decoding, narrow bands, chunked regions): each query tile meets
    only the keys it can reach, with a ``[B, 1, T, K]`` mask of that size. A tile whose pairs are
    all in needs no mask; one whose region is a rectangle ending in a causal square (DCA's same
    chunk) is two unmasked blocks. Left padding touches only the first ``padded`` keys
    (:func:`padded_keys`): a tile meets them with a mask, and the rest as if no sequence were padded.
    """
    for start in range(0, q_len, tile):
        stop = min(q_len, start + tile)
        rows = torch.arange(start + offset, stop + offset, device=device)
        regions = [_region(rows, lo, hi, padded, key_padding, span)] if padded else []
        if padded < kv_len:
            regions.append(_region(rows, lo, hi, kv_len, None, span, first_key=padded))
        for keys, allowed in regions:
            if keys is not None:
                yield from _tile_blocks(slice(start, stop), keys, allowed, dtype)


def padded_keys(key_padding: torch.Tensor | None, q_len: int, kv_len: int) -> int:
    """How many first keys a call meets with a padding mask: none without padding, all of them in
    decoding (one small masked call is cheapest), else those up to the last padded key in some
    sequence: the longest left padding (``Lkv`` when a sequence is padded on the right)."""
    if key_padding is None:
        return 0
    if q_len <= SMALL_QUERY:
        return kv_len
    padded = (~key_padding).any(0).nonzero()
    return int(padded[-1]) + 1 if padded.numel() else 0


def first_real_keys(key_padding: torch.Tensor) -> torch.Tensor | None:
    """Each sequence's first real key ``[B]`` where ``key_padding [B, Lkv]`` pads on the left only (False, then
    True), else ``None``."""
    keys = torch.arange(key_padding.shape[-1], device=key_padding.device)
    first = torch.where(key_padding.any(-1), key_padding.int().argmax(-1), key_padding.shape[-1])
    return first if torch.equal(key_padding, keys >= first[:, None]) else None


def key_position_offsets(positions: torch.Tensor, first_key: torch.Tensor | None) -> torch.Tensor | None:
    """``c [B]`` with ``positions[b, j] = j + c[b]`` for every real key ``j`` (from ``first_key[b]`` on), so that a span
    of key positions is a span of key indices; ``None`` where positions are not consecutive (packed documents)."""
    keys = torch.arange(positions.shape[-1], device=positions.device)
    offsets = positions[:, -1] - keys[-1]
    real = keys >= (0 if first_key is None else first_key[:, None])
    return offsets if bool((positions - keys == offsets[:, None])[real.expand_as(positions)].all()) else None


def _tile_blocks(rows: slice, keys: slice, allowed: torch.Tensor, dtype: torch.dtype):
    """The calls for query ``rows`` against ``keys`` with the pairs ``allowed`` (see :func:`_region`):
    none masked when all are in, a rectangle and a causal square when that is their shape, else one
    masked call."""
    if bool(allowed.all()):
        yield Block(rows, keys)
    elif _rectangle_then_causal(allowed):
        square = keys.stop - (rows.stop - rows.start)
        if square > keys.start:
            yield Block(rows, slice(keys.start, square))
        yield Block(rows, slice(square, keys.stop), causal=True)
    else:
        yield Block(rows, keys, additive(allowed, dtype))


def _rectangle_then_causal(allowed: torch.Tensor) -> bool:
    """Whether a ``[T, K]`` (or ``[B, 1, T, K]``) mask is all True but for a top-left causal ``T x T``
    square at its right end, in every sequence."""
    rows, keys = allowed.shape[-2:]
    if keys < rows:
        return False
    square = torch.ones(rows, rows, dtype=torch.bool, device=allowed.device).tril()
    return bool(allowed[..., : keys - rows].all()) and bool((allowed[..., keys - rows :] == square).all())


def _region(rows, lo, hi, kv_len, key_padding, span, first_key=0):
    """The keys in ``[first_key, kv_len)`` that query ``rows`` (absolute indices) can reach in a part,
    and which pairs are in it.

    Returns ``(keys, allowed)``: a slice of keys and a boolean ``[T, K]`` or ``[B, 1, T, K]`` mask
    (a 0-d True when every pair of the rectangle is in), or ``(None, None)`` when the rows reach no key.
    """
    bounds = region_bounds(rows, lo, hi, kv_len, span, first_key)
    if bounds is None:
        return None, None
    k_start, k_stop, uniform_span = bounds
    first_row, last_row = int(rows.min()), int(rows.max())
    whole = k_stop - 1 <= first_row - lo and (hi is None or k_start > last_row - hi)  # distance bounds cut nothing
    if whole and uniform_span and key_padding is None:  # decoding, and DCA's tiles inside one chunk
        return slice(k_start, k_stop), torch.ones((), dtype=torch.bool)
    return slice(k_start, k_stop), allowed_pairs(rows, slice(k_start, k_stop), lo, hi, key_padding, span)


def region_bounds(rows, lo, hi, kv_len, span, first_key=0) -> tuple[int, int, bool] | None:
    """``(k_start, k_stop, uniform)``: the keys in ``[first_key, kv_len)`` that ``rows`` reach in a part
    (``uniform``: one span for every row; see :func:`_span_keys`), or ``None`` when they reach none."""
    first_row, last_row = int(rows.min()), int(rows.max())
    k_start = first_key if hi is None else max(first_key, first_row - hi + 1)
    k_stop = min(kv_len, last_row - lo + 1)
    uniform_span = True
    if span is not None:
        key_span, positions = span
        span_first, span_stop = key_span(positions[:, rows])  # [B, T] each
        k_start, k_stop, uniform_span = _span_keys(span_first, span_stop, positions, k_start, k_stop)
    return (k_start, k_stop, uniform_span) if k_stop > k_start else None


def allowed_pairs(rows, keys: slice, lo, hi, key_padding, span) -> torch.Tensor:
    """Which pairs of ``rows`` x ``keys`` are in the part: ``lo <= i - j < hi``, real keys, inside the
    rows' key spans. ``[T, K]``, or ``[B, 1, T, K]`` with padding or spans."""
    distance = rows[:, None] - torch.arange(keys.start, keys.stop, device=rows.device)[None, :]  # [T, K]
    real = None if key_padding is None else key_padding[:, None, None, keys]  # [B, 1, 1, K]
    if span is None:
        return covers(distance, lo, hi, real)
    key_span, positions = span
    span_first, span_stop = key_span(positions[:, rows])  # [B, T] each
    bounds = (span_first[:, None, :, None], span_stop[:, None, :, None])
    return covers(distance, lo, hi, real, positions[:, None, None, keys], bounds)  # [B, 1, T, K]


def _span_keys(span_first, span_stop, positions, k_start, k_stop):
    """The keys in ``[k_start, k_stop)`` whose positions fall in some row's span ``[span_first, span_stop)``
    (``[B, T]`` each; DCA's chunks are narrower than the distance bounds): ``(k_start, k_stop, uniform)``,
    ``uniform`` when every row has the same span and every key of the narrowed slice is in it.
    O(B * (T + K)), no T x K mask."""
    lowest, highest = span_first.min(), span_stop.max()
    key_positions = positions[:, k_start:k_stop]
    inside = (key_positions >= lowest) & (key_positions < highest)  # [B, K]
    reached = inside.any(0).nonzero()
    if not reached.numel():
        return k_start, k_start, True
    first, last = int(reached[0]), int(reached[-1])
    uniform = bool((span_first == lowest).all() and (span_stop == highest).all() and inside[:, first : last + 1].all())
    return k_start + first, k_start + last + 1, uniform


def additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``allowed`` as an additive mask (0 or -inf); on CUDA its rows are stored a multiple of 16 elements
    apart: CUDA's memory-efficient attention refuses a bias whose row stride is not a multiple of 8."""
    width = allowed.shape[-1]
    stored_width = -(-width // 16) * 16 if allowed.device.type == "cuda" else width
    stored = torch.zeros((*allowed.shape[:-1], stored_width), dtype=dtype, device=allowed.device)
    return stored[..., :width].masked_fill_(~allowed, NEG_INF)

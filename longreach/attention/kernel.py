"""One attention kernel for every position method: parts in, attention out.

A method is a set of disjoint :class:`~longreach.methods.Part` s (pairs ``lo <= i - j < hi``, with
query and key position shifts). Each part is plain softmax attention over its region with q and k
re-rotated by the part's shifts; the parts' results are merged by their log-sum-exp
(SPEC.md "STRING, efficiently")::

    O = (exp(lse_a) O_a + exp(lse_b) O_b) / (exp(lse_a) + exp(lse_b))

Memory is O(n): a region is never materialised as an n x n mask. An unbounded region
(``hi = None``) without padding is one causal call on a shifted square plus an unmasked rectangle;
a bounded region, or any region with key padding, is computed in query tiles of ``tile`` rows
against only the keys the tile can reach, with a tile-sized mask.

Queries are the last ``Lq`` of the ``Lkv`` keys (prefill: ``Lq = Lkv``; decode: ``Lq = 1`` against
the whole KV cache), so the distance of query row ``t`` to key ``j`` is ``t + Lkv - Lq - j``; with
left padding this index distance equals the position distance of every real token.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

from ..methods.base import Part
from .rotary import rotate

NEG_INF = float("-inf")
SMALL_QUERY = 16  # decoding and short chunks: one small masked tile is cheapest
MIN_BAND_TILE = 32  # narrower bands are computed with masked tiles
Block = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    parts: Sequence[Part],
    inv_freq: torch.Tensor,
    scaling: float | None = None,
    key_padding: torch.Tensor | None = None,
    sliding_window: int | None = None,
    logit_scale: float = 1.0,
    positions: torch.Tensor | None = None,
    backend: str = "auto",
    tile: int = 512,
) -> torch.Tensor:
    """Attention of rotated ``query [B, Hq, Lq, D]`` over rotated ``key``/``value [B, Hkv, Lkv, D]``.

    ``key_padding [B, Lkv]`` is False at padding keys. ``sliding_window`` (the model's, e.g.
    Mistral or Gemma 3 local layers) limits every part to ``i - j < sliding_window``.
    ``logit_scale`` multiplies the rotary part of the logits. ``positions [B, Lkv]``: the keys'
    absolute positions, for parts whose shifts or spans depend on them (default ``0 .. Lkv-1``;
    the queries are the last ``Lq``). Grouped-query attention when
    ``Hq`` is a multiple of ``Hkv``. Accumulates in float32; returns ``[B, Lq, Hq, D]`` in the
    input dtype. Rows that attend no key are 0.
    """
    batch, q_heads, q_len, head_dim = query.shape
    kv_len = key.shape[2]
    if q_len > kv_len:
        raise ValueError(f"query length {q_len} exceeds key length {kv_len}: queries must be the last keys")
    if q_heads % key.shape[1]:
        raise ValueError(f"query heads ({q_heads}) must be a multiple of key/value heads ({key.shape[1]})")
    scaling = 1.0 / math.sqrt(head_dim) if scaling is None else scaling
    if logit_scale != 1.0:
        rotary_dims = 2 * inv_freq.shape[-1]
        query = torch.cat((query[..., :rotary_dims] * logit_scale, query[..., rotary_dims:]), dim=-1)
    groups = q_heads // key.shape[1]
    if groups > 1:  # a view: no copy of the cache
        key, value = (t[:, :, None].expand(-1, -1, groups, -1, -1).flatten(1, 2) for t in (key, value))
    block = _pick_block(query, backend)
    offset = kv_len - q_len

    accumulate = torch.float64 if query.dtype == torch.float64 else torch.float32
    out = torch.zeros(batch, q_heads, q_len, value.shape[-1], dtype=accumulate, device=query.device)
    lse = torch.full((batch, q_heads, q_len), NEG_INF, dtype=accumulate, device=query.device)
    if positions is None:
        positions = torch.arange(kv_len, device=query.device).expand(batch, -1)
    q_positions = positions[:, offset:]
    for part in parts:
        hi = part.max_distance
        if sliding_window is not None:
            hi = sliding_window if hi is None else min(hi, sliding_window)
        if hi is not None and hi <= part.min_distance:
            continue
        q = _shifted(query, part.query_shift, q_positions, inv_freq)
        k = _shifted(key, part.key_shift, positions, inv_freq)
        lo = part.min_distance
        structured = key_padding is None and part.key_span is None and block is not _math and q_len > SMALL_QUERY
        if structured and hi is None:
            pieces = _unbounded(q, k, value, lo, offset, scaling, block)
        elif structured and hi - lo - 1 >= MIN_BAND_TILE:
            pieces = _band(q, k, value, lo, hi, offset, scaling, block, min(tile, hi - lo - 1))
        else:
            span = None if part.key_span is None else (part.key_span, positions)
            pieces = _masked_tiles(q, k, value, lo, hi, offset, scaling, key_padding, span, block, tile)
        for rows, part_out, part_lse in pieces:
            out[:, :, rows], lse[:, :, rows] = merge(out[:, :, rows], lse[:, :, rows], part_out, part_lse)
    return out.to(query.dtype).transpose(1, 2)


def _shifted(x: torch.Tensor, shift, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """``x`` moved by a constant shift, or by ``shift(positions)`` per token (``[B, L]`` -> ``[B, 1, L]``)."""
    if callable(shift):
        return rotate(x, shift(positions)[:, None, :].to(torch.float64), inv_freq)
    return rotate(x, shift, inv_freq) if shift else x


def merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two softmax attentions over disjoint key sets by their log-sum-exp, stably.

    The weight of ``a`` is ``exp(lse_a) / (exp(lse_a) + exp(lse_b)) = sigmoid(lse_a - lse_b)``,
    computed from the difference so that large log-sum-exps lose no precision. A row empty in one
    part (lse = -inf) takes the other part as it is; empty in both, it stays 0.
    """
    both_empty = torch.isneginf(lse_a) & torch.isneginf(lse_b)
    weight_a = torch.sigmoid(torch.where(both_empty, 0.0, lse_a - lse_b))
    weight_a, weight_b = (torch.where(both_empty, 0.0, w)[..., None] for w in (weight_a, 1 - weight_a))
    return out_a * weight_a + out_b.to(out_a.dtype) * weight_b, torch.logaddexp(lse_a, lse_b)


def _unbounded(q, k, v, lo, offset, scaling, block):
    """Pairs with ``i - j >= lo``, no padding: one unmasked rectangle and one causal square.

    Query row ``t`` (``i = t + offset``) sees keys ``j <= i - lo``. Rows from ``first`` on see
    something; keys below ``first + offset - lo`` are seen by all of them (rectangle), the rest form
    a square whose top-left-aligned causal mask is exactly the region.
    """
    q_len = q.shape[2]
    first = max(0, lo - offset)
    if first >= q_len:
        return []
    shared = first + offset - lo
    rows = slice(first, q_len)
    q_rows = q[:, :, rows]
    pieces = []
    if shared > 0:
        pieces.append((rows, *block(q_rows, k[:, :, :shared], v[:, :, :shared], None, False, scaling)))
    end = shared + (q_len - first)
    pieces.append((rows, *block(q_rows, k[:, :, shared:end], v[:, :, shared:end], None, True, scaling)))
    return pieces


def _band(q, k, v, lo, hi, offset, scaling, block, tile):
    """Pairs with ``lo <= i - j < hi``, no padding, ``tile <= hi - lo - 1``: three blocks per query tile.

    For the tile of rows ``i in [a, a + T)`` the reachable keys ``(a - hi, a + T - lo)`` split into
    an upper block ``[a - hi + 1, +T)`` where the region is ``u >= t`` (one constant T x T mask), a
    middle block every row sees whole, and a lower block ``[a - lo, +T)`` where the region is
    top-left causal. Work is the band's own area plus O(T^2) per tile; no n-sized mask.
    """
    q_len, kv_len = q.shape[2], k.shape[2]
    upper = torch.ones(tile, tile, dtype=torch.bool, device=q.device).tril(-1)  # True where u < t: outside
    upper = torch.zeros(upper.shape, dtype=q.dtype, device=q.device).masked_fill(upper, NEG_INF)
    pieces = []
    for start in range(0, q_len, tile):
        stop = min(q_len, start + tile)
        a, rows = start + offset, slice(start, stop)
        q_tile = q[:, :, rows]
        top = a - hi + 1
        if top + tile > 0:  # upper block, clipped at key 0
            first_key = max(0, top)
            mask = upper[: stop - start, first_key - top :]
            keys = slice(first_key, top + tile)
            pieces.append((rows, *_with_empty_rows(block(q_tile, k[:, :, keys], v[:, :, keys], mask, False, scaling), mask)))
        middle = slice(max(0, top + tile), max(0, a - lo))
        if middle.stop > middle.start:
            pieces.append((rows, *block(q_tile, k[:, :, middle], v[:, :, middle], None, False, scaling)))
        skip = max(0, lo - a)  # rows with i < lo see nothing in the lower block
        if skip < stop - start:
            lower_rows = slice(start + skip, stop)
            keys = slice(a + skip - lo, a - lo + (stop - start))
            pieces.append((lower_rows, *block(q[:, :, lower_rows], k[:, :, keys], v[:, :, keys], None, True, scaling)))
    return pieces


def _masked_tiles(q, k, v, lo, hi, offset, scaling, key_padding, span, block, tile):
    """Pairs with ``lo <= i - j < hi`` (``hi=None``: unbounded), unpadded keys and, when ``span =
    (key_span, positions)`` is given, key positions in ``key_span(query positions)``; a mask per tile.

    The general path (key padding, decoding, narrow bands, chunked regions): each query tile meets
    only the keys it can reach, with a ``[B, 1, T, K]`` mask of that size.
    """
    q_len, kv_len = q.shape[2], k.shape[2]
    pieces = []
    for start in range(0, q_len, tile):
        stop = min(q_len, start + tile)
        first_i, last_i = start + offset, stop - 1 + offset
        k_start = 0 if hi is None else max(0, first_i - hi + 1)
        k_stop = min(kv_len, last_i - lo + 1)
        if k_stop <= k_start:
            continue
        i = torch.arange(first_i, last_i + 1, device=q.device)[:, None]
        j = torch.arange(k_start, k_stop, device=q.device)[None, :]
        allowed = j <= i - lo
        if hi is not None:
            allowed &= j > i - hi
        if key_padding is not None:
            allowed = allowed[None, None] & key_padding[:, None, None, k_start:k_stop]  # [B, 1, T, K]
        if span is not None:
            key_span, positions = span
            span_first, span_stop = key_span(positions[:, first_i : last_i + 1])  # [B, T] each
            key_positions = positions[:, None, None, k_start:k_stop]
            allowed = allowed & (key_positions >= span_first[:, None, :, None]) & (key_positions < span_stop[:, None, :, None])
        mask = None if bool(allowed.all()) else _additive(allowed, q.dtype)
        rows, keys = slice(start, stop), slice(k_start, k_stop)
        result = block(q[:, :, rows], k[:, :, keys], v[:, :, keys], mask, False, scaling)
        pieces.append((rows, *_with_empty_rows(result, mask)))
    return pieces


def _with_empty_rows(result, mask):
    """Mark rows whose mask hides every key as empty (lse = -inf): backends may report 0 there."""
    out, lse = result
    if mask is not None:
        empty = torch.isneginf(mask).all(-1)
        if bool(empty.any()):
            lse = lse.masked_fill(empty.expand_as(lse), NEG_INF)
    return out, lse


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, NEG_INF)


# --- backends: one block of attention with its log-sum-exp ------------------------------------


def _cpu_flash(q, k, v, mask, causal, scaling):
    """PyTorch's CPU flash attention, which also returns the log-sum-exp."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=causal, attn_mask=mask, scale=scaling)
    return out.float(), lse


def _cuda_efficient(q, k, v, mask, causal, scaling):
    """PyTorch's memory-efficient CUDA attention, which returns the log-sum-exp when asked."""
    if mask is not None:
        mask = mask.expand(q.shape[0], q.shape[1], -1, -1)
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, mask, True, 0.0, causal, scale=scaling
    )
    return out.float(), lse[..., : q.shape[2]].float()


def _math(q, k, v, mask, causal, scaling):
    """Plain matmul-softmax in float32 (float64 for float64 inputs): any device, any dtype.

    Only ever called on tiles (the kernel routes it through the tiled path), so memory stays O(n).
    """
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    scores = (q.to(compute) @ k.to(compute).transpose(-1, -2)) * scaling
    if causal:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1), NEG_INF)
    if mask is not None:
        scores = scores + mask.to(compute)
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    return weights @ v.to(compute), lse


BACKENDS: dict[str, Block] = {"cpu_flash": _cpu_flash, "cuda_efficient": _cuda_efficient, "math": _math}


def _pick_block(query: torch.Tensor, backend: str) -> Block:
    if backend == "auto":
        if query.dtype == torch.float64:
            backend = "math"
        else:
            backend = {"cpu": "cpu_flash", "cuda": "cuda_efficient"}.get(query.device.type, "math")
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of: auto, {', '.join(BACKENDS)}")
    return BACKENDS[backend]

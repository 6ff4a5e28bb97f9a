"""One attention kernel for every position method: parts in, attention out.

A method is a set of disjoint :class:`~longreach.methods.Part` s (pairs ``lo <= i - j < hi``, with
query and key position shifts). Each part is plain softmax attention over its region with q and k
re-rotated by the part's shifts; the parts' results are merged by their log-sum-exp
(SPEC.md "STRING, efficiently")::

    O = (exp(lse_a) O_a + exp(lse_b) O_b) / (exp(lse_a) + exp(lse_b))

Memory is O(n): a region is never materialised as an n x n mask. An unbounded region (``hi =
None``) is one causal call on a shifted square plus an unmasked rectangle and a band is three blocks
per query tile (:func:`_band`); left padding adds masked tiles over the padded first keys only
(:func:`_blocks`). Decoding, narrow bands and chunked regions (DCA) use query tiles against only the
keys a tile can reach, with a tile-sized mask.
Drop Attention needs whole rows: :mod:`.rows` computes them a tile of queries at a time. A part may move some rotary pairs only, per query head (DPE): where query heads sharing a
key/value head move different pairs, prefill repeats keys and values per query head and decoding
puts the moved and the plain keys side by side (:func:`_augmented`).

Queries are the last ``Lq`` of the ``Lkv`` keys (prefill: ``Lq = Lkv``; decode: ``Lq = 1`` against
the whole KV cache), so the distance of query row ``t`` to key ``j`` is ``t + Lkv - Lq - j``; with
left padding this index distance equals the position distance of every real token.
"""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from typing import Callable, NamedTuple, Sequence

import torch

from ..methods.base import Part
from . import flex
from .rotary import apply_rotation, compute_dtype, rotate, rotation

NEG_INF = float("-inf")
SMALL_QUERY = 16  # decoding and short chunks: one small masked tile is cheapest
MIN_BAND_TILE = 32  # narrower bands are computed with masked tiles
MAX_FOLDED_BLOCKS = 64  # decoding: at most this many per-chunk parts replace a per-token key shift


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    parts: Sequence[Part],
    inv_freq: torch.Tensor,
    scaling: float | None = None,
    key_padding: torch.Tensor | None = None,
    sliding_window: int | None = None,
    logit_scale: float | torch.Tensor = 1.0,
    positions: torch.Tensor | None = None,
    drop: torch.Tensor | None = None,
    backend: str = "auto",
    tile: int = 512,
) -> torch.Tensor:
    """Attention of rotated ``query [B, Hq, Lq, D]`` over rotated ``key``/``value [B, Hkv, Lkv, D]``.

    ``key_padding [B, Lkv]`` is False at padding keys. ``sliding_window`` (the model's, e.g.
    Mistral or Gemma 3 local layers) limits every part to ``i - j < sliding_window``.
    ``logit_scale`` (a number, or one per sequence ``[B]``) multiplies the rotary part of the logits. ``positions [B, Lkv]``: the keys'
    absolute positions, for parts whose shifts or spans depend on them (default ``0 .. Lkv-1``;
    the queries are the last ``Lq``). ``drop [B, Lq]``: Drop Attention rates per query (see
    :func:`.rows.drop_below_quantile`); rows from the first dropping one on are computed whole, a tile
    at a time. Grouped-query attention when ``Hq`` is a multiple of ``Hkv``. Accumulates in float32;
    returns ``[B, Lq, Hq, D]`` in the input dtype. Rows that attend no key are 0.
    """
    batch, q_heads, q_len, head_dim = query.shape
    kv_len = key.shape[2]
    if q_len > kv_len:
        raise ValueError(f"query length {q_len} exceeds key length {kv_len}: queries must be the last keys")
    if q_heads % key.shape[1]:
        raise ValueError(f"query heads ({q_heads}) must be a multiple of key/value heads ({key.shape[1]})")
    offset = kv_len - q_len
    dropping = drop is not None and bool((drop > 0).any())
    split = _pairs_split_groups(parts, key.shape[1], q_heads)
    if split and (q_len > SMALL_QUERY or dropping):
        key, value = _expand_heads(key, q_heads), _expand_heads(value, q_heads)  # prefill: as DPE's official code
    augment = split and key.shape[1] < q_heads  # decoding: two key sets side by side, see _augmented
    if dropping:
        common = dict(scaling=scaling, key_padding=key_padding, sliding_window=sliding_window, logit_scale=logit_scale,
                      positions=positions)
        return _attention_with_drop(query, key, value, parts, inv_freq, drop, common, backend, tile)
    query, key, scaling, positions = _prepare(query, key, inv_freq, scaling, logit_scale, positions)
    block = _pick_block(query, backend)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    if needs_grad and block is flex.part_attention and query.device.type != "cuda":
        raise ValueError(f"backend='flex' has no backward on {query.device.type} (PyTorch's FlexAttention has one on CUDA only): "
                         "use backend='auto' or 'math' to compute gradients here")
    # backends without a backward of their own run on tiles, differentiated by _math_backward (O(tile * n) memory)
    whole_blocks = block is not _math and not (needs_grad and block not in BACKWARDS)

    q_positions = positions[:, offset:]
    padded = 0 if block is flex.part_attention else _padded_keys(key_padding, q_len, kv_len)  # flex masks padding itself
    if q_len <= SMALL_QUERY:
        parts = _fold_block_key_shifts(parts, positions)
    plans, shifted, shifted_keys = [], [], {}
    for part in parts:
        lo, hi = part.min_distance, _upper_bound(part, sliding_window)
        if hi is not None and hi <= lo:
            continue
        if augment and part.pairs is not None:
            q, k = _augmented(query, key, part, q_positions, positions, inv_freq)
        else:
            q = _shifted(query, part.query_shift, q_positions, inv_freq, part.pairs)
            if (k := shifted_keys.get((id(part.key_shift), id(part.pairs)))) is None:  # parts sharing a key shift (DCA's three) rotate once
                k = shifted_keys[id(part.key_shift), id(part.pairs)] = _shifted_keys(key, part.key_shift, positions, inv_freq, part.pairs)
        if block is flex.part_attention:
            span = None if part.key_span is None else (*part.key_span(q_positions), positions)
            region = flex.Region(lo, hi, offset, key_padding, span)
            plans.append(lambda region=region: [Block(slice(0, q_len), slice(0, kv_len), region.block_mask(batch, q_len, kv_len, query.device))])
        else:
            structured = whole_blocks and part.key_span is None and q_len > SMALL_QUERY
            span = None if part.key_span is None else (part.key_span, positions)
            plans.append(lambda lo=lo, hi=hi, span=span, structured=structured: _blocks(
                q_len, kv_len, lo, hi, offset, key_padding, padded, span, tile, structured, query.dtype, query.device))
        shifted += [q, k]
    if not shifted:  # the model's sliding window excludes every part
        return torch.zeros(batch, q_len, q_heads, value.shape[-1], dtype=query.dtype, device=query.device)
    if needs_grad and block is not flex.part_attention:  # FlexAttention differentiates itself
        out, _ = _PartsAttention.apply(plans, block, scaling, value, *shifted)
    else:
        out, _ = _run(plans, block, scaling, value, shifted)
    return out.to(query.dtype).transpose(1, 2)


def _fold_block_key_shifts(parts: Sequence[Part], positions: torch.Tensor) -> list[Part]:
    """Decoding: a part whose key shift is constant on aligned blocks of key positions (DCA's chunks)
    becomes one part per block, the block's shift moved to the query side.

    Keys of a block all sit at ``j + sigma``, so ``(i + s_q(i)) - (j + sigma) = (i + s_q(i) - sigma) - j``:
    the query turns by ``-sigma`` and the cached keys are used as they are. A decoding step then
    rotates one query per block instead of all ``n`` cached keys.
    """
    if all(part.key_shift_block is None for part in parts):
        return list(parts)
    lowest, highest = int(positions.min()), int(positions.max())
    folded = []
    for part in parts:
        size = part.key_shift_block
        starts = range(lowest // size * size, highest + 1, size) if size is not None else range(0)
        if not starts or len(starts) > MAX_FOLDED_BLOCKS:  # tiny chunks: rotating the keys is cheaper
            folded.append(part)
            continue
        for start in starts:
            sigma = float(part.key_shift(torch.tensor([start], dtype=torch.float64))[0])
            folded.append(Part(part.min_distance, part.max_distance, query_shift=_minus(part.query_shift, sigma),
                               key_span=_within(part.key_span, start, start + size), pairs=part.pairs))
    return folded


def _minus(shift, sigma: float):
    """The shift ``shift - sigma`` (a constant, or a function of positions)."""
    return (lambda p: shift(p) - sigma) if callable(shift) else shift - sigma


def _within(key_span, first: int, stop: int):
    """``key_span`` cut to the key positions ``[first, stop)`` (``None``: every key position)."""
    def span(p):
        if key_span is None:
            return torch.full_like(p, first), torch.full_like(p, stop)
        lo, hi = key_span(p)
        return lo.clamp(min=first), hi.clamp(max=stop)
    return span


class Block(NamedTuple):
    """One call of a backend: the query ``rows`` against the ``keys``, with an additive ``mask`` or a
    top-left ``causal`` mask (or neither); for the FlexAttention backend, ``mask`` is the part's block mask."""

    rows: slice
    keys: slice
    mask: object = None  # an additive mask tensor, a FlexAttention BlockMask, or None
    causal: bool = False


def _run(plans, block, scaling, value, shifted):
    """Every part's blocks, merged by log-sum-exp: ``(out, lse)`` in the accumulation dtype."""
    q0 = shifted[0]
    batch, heads, q_len = q0.shape[:3]
    accumulate = compute_dtype(q0.dtype)

    def nothing_attended():
        return (torch.zeros(batch, heads, q_len, value.shape[-1], dtype=accumulate, device=q0.device),
                torch.full((batch, heads, q_len), NEG_INF, dtype=accumulate, device=q0.device))

    out = lse = None  # allocated at the first block that covers only some rows; a whole first block is taken as it is
    for plan, q, k in zip(plans, shifted[0::2], shifted[1::2]):
        run = _block_for(block, q, value)
        for b in plan():
            part_out, part_lse = run(q[:, :, b.rows], k[:, :, b.keys], value[:, :, b.keys], b.mask, b.causal, scaling)
            if isinstance(b.mask, torch.Tensor):
                part_out, part_lse = _with_empty_rows(part_out, part_lse, b.mask)
            whole = b.rows == slice(0, q_len)
            if out is None and whole:
                out, lse = part_out.to(accumulate), part_lse.to(accumulate)
                continue
            if out is None:
                out, lse = nothing_attended()
            if whole:  # not in place: FlexAttention's autograd keeps its outputs
                out, lse = merge(out, lse, part_out, part_lse)
            else:
                out[:, :, b.rows], lse[:, :, b.rows] = merge(out[:, :, b.rows], lse[:, :, b.rows], part_out, part_lse)
    return (out, lse) if out is not None else nothing_attended()  # no part reaches any key


def _block_for(block: Callable, q: torch.Tensor, value: torch.Tensor) -> Callable:
    """The backend for a part: the chosen one, or the math backend where query and key are wider than the
    value (DPE's side-by-side keys, :func:`_augmented`), which the flash kernels refuse and FlexAttention takes."""
    return block if q.shape[-1] == value.shape[-1] or block is flex.part_attention else _math


class _PartsAttention(torch.autograd.Function):
    """The parts' attention with an exact backward.

    The merged output is one softmax over all keys, each scored in its part, so the gradient of
    every block is the flash-attention backward evaluated with the *merged* output and
    log-sum-exp (as split-KV flash attention does): ``P = exp(S - lse)``,
    ``dS = P * (dO V^T - rowsum(dO * O))``. The backward replays the same blocks.
    """

    @staticmethod
    def forward(ctx, plans, block, scaling, value, *shifted):
        out, lse = _run(plans, block, scaling, value, shifted)
        ctx.save_for_backward(value, out, lse, *shifted)
        ctx.plans, ctx.backward, ctx.scaling = plans, BACKWARDS.get(block, _math_backward), scaling
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _):
        value, out, lse, *shifted = ctx.saved_tensors
        lse = lse.masked_fill(torch.isneginf(lse), float("inf"))  # rows that attend nothing: P = 0
        accumulate = out.dtype
        grad_value = torch.zeros(value.shape, dtype=accumulate, device=value.device)
        grads = [torch.zeros(t.shape, dtype=accumulate, device=t.device) for t in shifted]
        for index, plan in enumerate(ctx.plans):
            q, k = shifted[2 * index], shifted[2 * index + 1]
            grad_q, grad_k = grads[2 * index], grads[2 * index + 1]
            backward = ctx.backward if q.shape[-1] == value.shape[-1] else _math_backward
            for b in plan():
                dq, dk, dv = backward(grad_out[:, :, b.rows], q[:, :, b.rows], k[:, :, b.keys], value[:, :, b.keys],
                                          out[:, :, b.rows], lse[:, :, b.rows], b.mask, b.causal, ctx.scaling)
                grad_q[:, :, b.rows] += dq
                grad_k[:, :, b.keys] += dk
                grad_value[:, :, b.keys] += dv
        return (None, None, None, grad_value.to(value.dtype), *(g.to(t.dtype) for g, t in zip(grads, shifted)))


def _attention_with_drop(query, key, value, parts, inv_freq, drop, common, backend, tile):
    """Rows before the first dropping one take the fast path (DDA drops only beyond the window);
    the rest are computed whole, a tile at a time (:func:`.rows.dropped_attention`)."""
    from . import rows  # which builds on this module

    offset = key.shape[2] - query.shape[2]
    first = int((drop > 0).any(0).nonzero()[0])
    accumulate = compute_dtype(query.dtype)
    pieces = []
    if first:
        keep = offset + first
        head = {**common, "key_padding": None if common["key_padding"] is None else common["key_padding"][:, :keep],
                "positions": None if common["positions"] is None else common["positions"][:, :keep]}
        out = attention(query[:, :, :first], key[:, :, :keep], value[:, :, :keep], parts, inv_freq, backend=backend, tile=tile, **head)
        pieces.append(out.transpose(1, 2).to(accumulate))
    indices = torch.arange(offset + first, key.shape[2], device=query.device)
    pieces.append(rows.dropped_attention(query[:, :, first:], key, value, parts, inv_freq, indices, drop[:, first:], **common))
    return torch.cat(pieces, dim=2).to(query.dtype).transpose(1, 2)


def _prepare(query, key, inv_freq, scaling, logit_scale, positions):
    """Default scale and positions, the logit scale on the query's rotary dims.

    Keys stay at their own head count: each part shifts them once per KV head, then expands.
    """
    scaling = 1.0 / math.sqrt(query.shape[-1]) if scaling is None else scaling
    if isinstance(logit_scale, torch.Tensor) or logit_scale != 1.0:
        rotary_dims = 2 * inv_freq.shape[-1]
        factor = per_sequence(logit_scale, query.dtype, query.device)
        query = torch.cat((query[..., :rotary_dims] * factor, query[..., rotary_dims:]), dim=-1)
    if positions is None:
        positions = torch.arange(key.shape[2], device=query.device).expand(query.shape[0], -1)
    return query, key, scaling, positions


def per_sequence(value: float | torch.Tensor, dtype: torch.dtype, device) -> torch.Tensor:
    """A number, or one value per sequence ``[B]`` shaped ``[B, 1, 1, 1]`` to broadcast over heads and positions."""
    value = torch.as_tensor(value, dtype=dtype, device=device)
    return value.view(-1, 1, 1, 1) if value.dim() else value


def _expand_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Key/value heads repeated for grouped-query attention (a copy: only for backends without grouped queries)."""
    groups = heads // x.shape[1]
    return x if groups == 1 else x[:, :, None].expand(-1, -1, groups, -1, -1).flatten(1, 2)


def _upper_bound(part: Part, sliding_window: int | None) -> int | None:
    """The part's exclusive distance bound under the model's sliding window (``None``: unbounded)."""
    if sliding_window is None:
        return part.max_distance
    return sliding_window if part.max_distance is None else min(part.max_distance, sliding_window)


def _shifted(x: torch.Tensor, shift, positions: torch.Tensor, inv_freq: torch.Tensor, pairs: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` moved by a constant shift, or by ``shift(positions)`` per token (``[B, L]`` -> ``[B, 1, L]``);
    with ``pairs`` (``[query heads, rotary pairs]``), only the marked pairs of each head move."""
    if callable(shift):
        moved = apply_rotation(x, *_shift_angles(shift, positions, inv_freq, compute_dtype(x.dtype)))
    else:
        moved = rotate(x, shift, inv_freq) if shift else x
    return moved if pairs is None else torch.where(_pair_dims(pairs, x.shape[1], x.shape[-1], x.device), moved, x)


def _shift_angles(shift, positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` ``[B, 1, L, D_rot / 2]`` of a per-token shift at ``positions [B, L]``; the shift is
    evaluated in float64, so that fractional shifts (Leaky ReRoPE) of large positions keep their precision.
    A shift per group of rotary pairs (``[B, L, G]``) gives each pair its group's angle."""
    values = shift(positions.to(torch.float64))
    if values.dim() == 2:
        return rotation(values[:, None, :], inv_freq, dtype, positions.device)
    pairs = inv_freq.shape[-1]
    if pairs % values.shape[-1]:
        raise ValueError(f"a shift with {values.shape[-1]} frequency groups cannot split {pairs} rotary pairs evenly")
    values = values.repeat_interleave(pairs // values.shape[-1], dim=-1)[:, None]  # [B, 1, L, P]
    angle = values * inv_freq.to(device=positions.device, dtype=torch.float64)
    return angle.cos().to(dtype), angle.sin().to(dtype)


def _pair_dims(pairs: torch.Tensor, heads: int, dim: int, device) -> torch.Tensor:
    """The dimensions ``[1, heads, 1, dim]`` of the rotary pairs marked in ``pairs [query heads, P]``
    (both halves of each pair; never the dimensions without rotation). With fewer ``heads`` than query
    heads (a key/value head serves a group whose marks agree), each group's first row is used."""
    marks = pairs[:: pairs.shape[0] // heads].to(device)
    rest = torch.zeros(heads, dim - 2 * marks.shape[-1], dtype=torch.bool, device=device)
    return torch.cat((marks, marks, rest), dim=-1)[None, :, None, :]


def _pairs_split_groups(parts: Sequence[Part], kv_heads: int, q_heads: int) -> bool:
    """Whether some part moves different pairs in query heads that share a key/value head (DPE's per-head pairs)."""
    for part in parts:
        if part.pairs is not None:
            if part.pairs.shape[0] != q_heads:
                raise ValueError(f"a part's pairs mark {part.pairs.shape[0]} heads; the model has {q_heads} query heads")
            groups = part.pairs.view(kv_heads, q_heads // kv_heads, -1)
            if not bool((groups == groups[:, :1]).all()):
                return True
    return False


def _augmented(query, key, part: Part, q_positions, positions, inv_freq) -> tuple[torch.Tensor, torch.Tensor]:
    """Query heads with their own pairs against shared key/value heads, without repeating the keys.

    Each query head's score is ``q_sel . k_moved + q_rest . k``: its marked pairs against the moved keys,
    the rest against the keys as they are. Side by side, that is one dot product of ``[q_sel, q_rest]``
    (``[B, Hq, Lq, 2D]``) with ``[k_moved, k]`` (``[B, Hkv, L, 2D]``, still one per key/value head): exact,
    and for a decoding step far less traffic than keys and values repeated per query head. The value
    keeps its dimension, so these blocks run on the math backend (see :func:`_block_for`).
    """
    moved_q = _shifted(query, part.query_shift, q_positions, inv_freq)
    moved_k = _shifted_keys(key, part.key_shift, positions, inv_freq)
    dims = _pair_dims(part.pairs, query.shape[1], query.shape[-1], query.device)
    q = torch.cat((moved_q.masked_fill(~dims, 0.0), query.masked_fill(dims, 0.0)), dim=-1)
    return q, torch.cat((moved_k, key), dim=-1)


def _shifted_keys(key: torch.Tensor, shift, positions: torch.Tensor, inv_freq: torch.Tensor, pairs: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`_shifted` for keys, with the angles of a per-token shift taken from :data:`KEY_ROTATIONS`."""
    if not callable(shift):
        return _shifted(key, shift, positions, inv_freq, pairs)
    moved = apply_rotation(key, *KEY_ROTATIONS.get(shift, positions, inv_freq, compute_dtype(key.dtype)))
    return moved if pairs is None else torch.where(_pair_dims(pairs, key.shape[1], key.shape[-1], key.device), moved, key)


class KeyRotations:
    """The ``(cos, sin)`` of per-token key shifts (ReRoPE, Self-Extend, DCA), kept across layers and decoding steps.

    Every layer of a forward pass moves the same key positions by the same shift, and a decoding step
    adds one position: the angles are computed once per pass, and a step computes only the new ones.
    An entry is used only for the same shift object, equal ``inv_freq`` and equal leading positions
    (checked on every call, O(n)); shifts act on each position on its own, as every method's do.
    """

    def __init__(self, size: int = 8):
        self.size = size
        self.entries: OrderedDict[int, tuple] = OrderedDict()

    def get(self, shift, positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` ``[B, 1, Lkv, D_rot / 2]`` for keys at ``positions [B, Lkv]``."""
        entry = self.entries.get(id(shift))
        if entry is not None and self._extends(entry, shift, positions, inv_freq, dtype):
            _, known, _, cos, sin = entry
            if known.shape[1] == positions.shape[1]:
                self.entries.move_to_end(id(shift))
                return cos, sin
            new_cos, new_sin = _shift_angles(shift, positions[:, known.shape[1] :], inv_freq, dtype)
            cos, sin = torch.cat((cos, new_cos), dim=-2), torch.cat((sin, new_sin), dim=-2)
        else:
            cos, sin = _shift_angles(shift, positions, inv_freq, dtype)
        self.entries[id(shift)] = (shift, positions.clone(), inv_freq.detach().clone(), cos, sin)
        self.entries.move_to_end(id(shift))
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)
        return cos, sin

    @staticmethod
    def _extends(entry, shift, positions, inv_freq, dtype) -> bool:
        held_shift, known, held_inv_freq, cos, _ = entry
        return (held_shift is shift and cos.dtype == dtype and known.device == positions.device
                and known.shape[0] == positions.shape[0] and known.shape[1] <= positions.shape[1]
                and held_inv_freq.shape == inv_freq.shape and torch.equal(held_inv_freq, inv_freq.to(held_inv_freq.device))
                and torch.equal(known, positions[:, : known.shape[1]]))


KEY_ROTATIONS = KeyRotations()


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


def _blocks(q_len, kv_len, lo, hi, offset, key_padding, padded, span, tile, structured, dtype, device):
    """The calls that cover a part's pairs ``lo <= i - j < hi``. ``structured`` (a whole-blocks backend,
    no key span, more than a few queries): the padded first ``padded`` keys (:func:`_padded_keys`) with
    masked tiles, the rest with the unmasked plan of an unbounded region or a wide band, as if no
    sequence were padded. Otherwise masked tiles (:func:`_masked_tiles`)."""
    if not structured or (hi is not None and hi - lo - 1 < MIN_BAND_TILE):
        return _masked_tiles(q_len, kv_len, lo, hi, offset, key_padding, padded, span, tile, dtype, device)
    prefix = _masked_tiles(q_len, padded, lo, hi, offset, key_padding, padded, None, tile, dtype, device) if padded else ()
    if hi is None:
        return itertools.chain(prefix, _unbounded(q_len, lo, offset, padded))
    # bands use tiles twice as tall: fewer, larger unmasked calls beat the wasted diagonal halves (measured)
    band_tile = min(2 * tile, hi - lo - 1)
    return itertools.chain(prefix, _band(q_len, lo, hi, offset, band_tile, dtype, device, padded))


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

    For the tile of rows ``i in [a, a + T)`` the reachable keys ``(a - hi, a + T - lo)`` split into
    an upper block ``[a - hi + 1, +T)`` where the region is ``u >= t`` (one constant T x T mask), a
    middle block every row sees whole, and a lower block ``[a - lo, +T)`` where the region is
    top-left causal. Work is the band's own area plus O(T^2) per tile; no n-sized mask.
    """
    upper = torch.ones(tile, tile, dtype=torch.bool, device=device).tril(-1)  # True where u < t: outside
    upper = torch.zeros(upper.shape, dtype=dtype, device=device).masked_fill(upper, NEG_INF)
    for start in range(0, q_len, tile):
        stop = min(q_len, start + tile)
        a, rows = start + offset, slice(start, stop)
        top = a - hi + 1
        if top + tile > first_key:  # upper block, clipped at the first key
            first = max(first_key, top)
            yield Block(rows, slice(first, top + tile), upper[: stop - start, first - top :])
        middle = slice(max(first_key, top + tile), max(first_key, a - lo))
        if middle.stop > middle.start:
            yield Block(rows, middle)
        skip = max(0, first_key + lo - a)  # rows with i - lo < first_key see nothing in the lower block
        if skip < stop - start:
            yield Block(slice(start + skip, stop), slice(a + skip - lo, a - lo + (stop - start)), causal=True)


def _masked_tiles(q_len, kv_len, lo, hi, offset, key_padding, padded, span, tile, dtype, device):
    """Pairs with ``lo <= i - j < hi`` (``hi=None``: unbounded), unpadded keys and, when ``span =
    (key_span, positions)`` is given, key positions in ``key_span(query positions)``; a mask per tile.

    The general path (key padding, decoding, narrow bands, chunked regions): each query tile meets
    only the keys it can reach, with a ``[B, 1, T, K]`` mask of that size. A tile whose pairs are
    all in needs no mask; one whose region is a rectangle ending in a causal square (DCA's same
    chunk) is two unmasked blocks. Left padding touches only the first ``padded`` keys
    (:func:`_padded_keys`): a tile meets them with a mask, and the rest as if no sequence were padded.
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


def _padded_keys(key_padding: torch.Tensor | None, q_len: int, kv_len: int) -> int:
    """How many first keys a call meets with a padding mask: none without padding, all of them in
    decoding (one small masked call is cheapest), else those up to the last padded key in some
    sequence: the longest left padding (``Lkv`` when a sequence is padded on the right)."""
    if key_padding is None:
        return 0
    if q_len <= SMALL_QUERY:
        return kv_len
    padded = (~key_padding).any(0).nonzero()
    return int(padded[-1]) + 1 if padded.numel() else 0


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
        yield Block(rows, keys, _additive(allowed, dtype))


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
    bounds = _region_bounds(rows, lo, hi, kv_len, span, first_key)
    if bounds is None:
        return None, None
    k_start, k_stop, uniform_span = bounds
    first_row, last_row = int(rows.min()), int(rows.max())
    whole = k_stop - 1 <= first_row - lo and (hi is None or k_start > last_row - hi)  # distance bounds cut nothing
    if whole and uniform_span and key_padding is None:  # decoding, and DCA's tiles inside one chunk
        return slice(k_start, k_stop), torch.ones((), dtype=torch.bool)
    return slice(k_start, k_stop), _allowed(rows, slice(k_start, k_stop), lo, hi, key_padding, span)


def _region_bounds(rows, lo, hi, kv_len, span, first_key=0) -> tuple[int, int, bool] | None:
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


def _allowed(rows, keys: slice, lo, hi, key_padding, span) -> torch.Tensor:
    """Which pairs of ``rows`` x ``keys`` are in the part: ``lo <= i - j < hi``, real keys, inside the
    rows' key spans. ``[T, K]``, or ``[B, 1, T, K]`` with padding or spans."""
    i, j = rows[:, None], torch.arange(keys.start, keys.stop, device=rows.device)[None, :]
    allowed = j <= i - lo
    if hi is not None:
        allowed &= j > i - hi
    if key_padding is not None:
        allowed = allowed[None, None] & key_padding[:, None, None, keys]  # [B, 1, T, K]
    if span is not None:
        key_span, positions = span
        span_first, span_stop = key_span(positions[:, rows])
        key_positions = positions[:, None, None, keys]
        allowed = allowed & (key_positions >= span_first[:, None, :, None]) & (key_positions < span_stop[:, None, :, None])
    return allowed


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


def _with_empty_rows(out, lse, mask):
    """Mark rows whose mask hides every key as empty (lse = -inf): backends may report 0 there."""
    empty = torch.isneginf(mask).all(-1)
    if bool(empty.any()):
        lse = lse.masked_fill(empty.expand_as(lse), NEG_INF)
    return out, lse


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``allowed`` as an additive mask (0 or -inf); on CUDA its rows are stored a multiple of 16 elements
    apart: CUDA's memory-efficient attention refuses a bias whose row stride is not a multiple of 8."""
    width = allowed.shape[-1]
    stored_width = -(-width // 16) * 16 if allowed.device.type == "cuda" else width
    stored = torch.zeros((*allowed.shape[:-1], stored_width), dtype=dtype, device=allowed.device)
    return stored[..., :width].masked_fill_(~allowed, NEG_INF)


# --- backends: one block of attention with its log-sum-exp ------------------------------------


def _cpu_flash(q, k, v, mask, causal, scaling):
    """PyTorch's CPU flash attention, which also returns the log-sum-exp."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=causal, attn_mask=mask, scale=scaling)
    return out.float(), lse


def _cuda_efficient(q, k, v, mask, causal, scaling):
    """PyTorch's memory-efficient CUDA attention, which returns the log-sum-exp when asked.

    It has no grouped-query attention: the block's keys and values are repeated per query head.
    """
    k, v = _expand_heads(k, q.shape[1]), _expand_heads(v, q.shape[1])
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
    compute = compute_dtype(q.dtype)
    scores = _scores(q, k, mask, causal, scaling, compute)
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    return _grouped_matmul(weights, v.to(compute)), lse


def _grouped_matmul(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x [B, Hq, T, K] @ y [B, Hkv, K, D]`` with query head ``h`` using key/value head ``h // (Hq / Hkv)``,
    without repeating ``y`` (grouped-query attention by broadcasting)."""
    groups = x.shape[1] // y.shape[1]
    if groups == 1:
        return x @ y
    rows = x.shape[2]  # a group's query rows stacked: one matmul per key/value head (broadcasting y would copy it per query head)
    return (x.unflatten(1, (y.shape[1], groups)).flatten(2, 3) @ y).unflatten(2, (groups, rows)).flatten(1, 2)


def _scores(q, k, mask, causal, scaling, compute: torch.dtype) -> torch.Tensor:
    """One block's scores in ``compute``: ``q k^T`` times ``scaling``, with a top-left causal and/or additive mask."""
    scores = _grouped_matmul(q.to(compute), k.to(compute).transpose(-1, -2)) * scaling
    if causal:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1), NEG_INF)
    if mask is not None:
        scores = scores + mask.to(compute)
    return scores


def _cpu_flash_backward(grad_out, q, k, v, out, lse, mask, causal, scaling):
    """PyTorch's CPU flash-attention backward, given the merged output and log-sum-exp (grouped-query natively)."""
    dtype = q.dtype
    grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out.to(dtype), q, k, v, out.to(dtype), lse.to(compute_dtype(dtype)), 0.0, causal, attn_mask=mask, scale=scaling
    )
    return tuple(g.to(out.dtype) for g in grads)


def _math_backward(grad_out, q, k, v, out, lse, mask, causal, scaling):
    """The attention backward written out (Dao et al. 2022, FlashAttention, Algorithm 4), for one tile:
    ``P = exp(S - lse)``, ``dV = P^T dO``, ``dS = P * (dO V^T - rowsum(dO * O))``, ``dQ = dS K s``, ``dK = dS^T Q s``.
    With grouped-query attention, ``dK`` and ``dV`` sum over the query heads sharing a key/value head."""
    compute = out.dtype
    q, k, v = q.to(compute), k.to(compute), v.to(compute)
    p = torch.exp(_scores(q, k, mask, causal, scaling, compute) - lse[..., None])
    grad_scores = p * (_grouped_matmul(grad_out, v.transpose(-1, -2)) - (grad_out * out).sum(-1, keepdim=True))
    return (_grouped_matmul(grad_scores, k) * scaling, _per_kv_head(grad_scores.transpose(-1, -2) @ q, k.shape[1]) * scaling,
            _per_kv_head(p.transpose(-1, -2) @ grad_out, k.shape[1]))


def _per_kv_head(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """A gradient per query head ``[B, Hq, K, D]`` summed over each key/value head's group ``[B, Hkv, K, D]``."""
    return grad if grad.shape[1] == kv_heads else grad.unflatten(1, (kv_heads, -1)).sum(2)


BACKENDS: dict[str, Callable] = {"cpu_flash": _cpu_flash, "cuda_efficient": _cuda_efficient, "flex": flex.part_attention, "math": _math}
BACKWARDS: dict[Callable, Callable] = {_cpu_flash: _cpu_flash_backward, _math: _math_backward}
"""Backends with a backward of their own; the others are differentiated tile by tile with :func:`_math_backward`."""


def _pick_block(query: torch.Tensor, backend: str) -> Callable:
    """``auto``: CPU flash attention on CPU; on CUDA compiled FlexAttention (memory-efficient attention
    without Triton), and for a decoding step (at most ``SMALL_QUERY`` queries) the math backend, whose
    one masked tile costs less than building a block mask and launching the compiled kernel; the math
    backend in float64 and on other devices."""
    if backend == "auto":
        if query.dtype == torch.float64 or (query.device.type == "cuda" and query.shape[2] <= SMALL_QUERY):
            backend = "math"
        elif query.device.type == "cuda":
            backend = "flex" if flex.available(query.device) else "cuda_efficient"
        else:
            backend = "cpu_flash" if query.device.type == "cpu" else "math"
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of: auto, {', '.join(BACKENDS)}")
    if backend == "flex" and not flex.available(query.device):
        raise ValueError(f"backend='flex' needs PyTorch's FlexAttention (torch >= 2.5, and Triton on CUDA); not available on {query.device}")
    return BACKENDS[backend]

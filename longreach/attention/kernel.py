"""One attention kernel for every position method: parts in, attention out.

A method is a set of disjoint :class:`~longreach.methods.Part` s (pairs ``lo <= i - j < hi``, with
query and key position shifts). Each part is plain softmax attention over its region with q and k
re-rotated by the part's shifts (:mod:`.shifts`); the calls that cover a part's region are its plan
(:mod:`.plan`), each run by a backend (:mod:`.backends`, :mod:`.flex`), and the parts' results are
merged by their log-sum-exp (:mod:`.merge`); backends without a backward of their own are
differentiated by :mod:`.autograd`. Drop Attention needs whole rows: :mod:`.rows` computes them a tile
of queries at a time. A part may move some rotary pairs only, per query head (DPE): where query heads
sharing a key/value head move different pairs, prefill repeats keys and values per query head and
decoding puts the moved and the plain keys side by side (:func:`.shifts.augmented`).

Queries are the last ``Lq`` of the ``Lkv`` keys (prefill: ``Lq = Lkv``; decode: ``Lq = 1`` against
the whole KV cache), so the distance of query row ``t`` to key ``j`` is ``t + Lkv - Lq - j``; with
left padding this index distance equals the position distance of every real token.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .parts import Part
from . import flex, fused, native, rows, windows
from .autograd import PartsAttention
from .backends import BACKENDS, BACKWARDS, expand_heads, math_block, pick
from .merge import merge, run
from .memo import MAX_HELD_MASK_ELEMENTS, Memo
from .plan import SMALL_QUERY, Block, blocks, padded_keys, upper_bound
from .rotary import compute_dtype, rotation
from .shifts import KEY_ROTATIONS, MovedKeys, augmented, fold_block_key_shifts, pairs_split_groups, prepare, shift_angles, shifted, shifted_keys


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
    memo: Memo | None = None,
    kept_keys: MovedKeys | None = None,
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

    ``memo``: a :class:`.memo.Memo` shared by the calls of one forward pass (the same positions, padding
    and parts in every call): what depends on those alone -- plans, block masks, shift angles -- is
    built by the first call and reused by the others. Where ``auto`` chose FlexAttention or the fused Triton
    kernel and compiling it fails, the call is computed by the tiled kernel with one warning
    (:func:`.flex.give_up`, :func:`.fused.give_up`), never an error.

    ``kept_keys``: this layer's :class:`.shifts.MovedKeys`, which keeps the keys moved by per-token key shifts
    across decoding steps (the tiled kernel; the fused kernel turns keys as it reads them).
    """
    arguments = (query, key, value, parts, inv_freq, scaling, key_padding, sliding_window, logit_scale, positions, drop, backend, tile, memo,
                 kept_keys)
    try:
        return _attention(*arguments)
    except Exception as error:
        failed = next((module for module in (flex, fused, native) if module.compile_failed(error)), None)
        if backend != "auto" or failed is None:
            raise
        failed.give_up(error)
        return _attention(*arguments)


def _attention(query, key, value, parts, inv_freq, scaling, key_padding, sliding_window, logit_scale, positions, drop, backend, tile,
               memo, kept_keys) -> torch.Tensor:
    """:func:`attention` itself."""
    batch, q_heads, q_len, head_dim = query.shape
    kv_len = key.shape[2]
    if q_len > kv_len:
        raise ValueError(f"query length {q_len} exceeds key length {kv_len}: queries must be the last keys")
    if q_heads % key.shape[1]:
        raise ValueError(f"query heads ({q_heads}) must be a multiple of key/value heads ({key.shape[1]})")
    offset = kv_len - q_len
    memo = Memo() if memo is None else memo
    # the first row that drops a score: a host sync, once per forward pass (the memo holds ``drop``, which the layers share)
    first_dropping = None if drop is None else memo.get("first dropping row", (drop,), (), lambda: first_dropping_row(drop))
    dropping = first_dropping is not None
    split = pairs_split_groups(parts, key.shape[1], q_heads)
    if split and (q_len > SMALL_QUERY or dropping):
        key, value = expand_heads(key, q_heads), expand_heads(value, q_heads)  # prefill: as DPE's official code
    augment = split and key.shape[1] < q_heads  # decoding: two key sets side by side, see augmented
    if dropping:
        common = dict(scaling=scaling, key_padding=key_padding, sliding_window=sliding_window, logit_scale=logit_scale,
                      positions=positions)
        return _attention_with_drop(query, key, value, parts, inv_freq, drop, first_dropping, common, backend, tile)
    query, key, scaling, positions = prepare(query, key, inv_freq, scaling, logit_scale, positions)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    block = pick(query, backend, fusable=not needs_grad and not split and all(part.pairs is None for part in parts))
    if block is native.parts_attention:
        geometry = (batch, q_len, kv_len, query.dtype, "cpu")
        moved_keys = lambda shift: _keys_moved(key, shift, None, positions, inv_freq, memo, geometry, kept_keys)
        out = native.attention(query, key, value, parts, inv_freq, scaling, sliding_window, positions, key_padding, memo, geometry, moved_keys)
        if out is not None:
            return out.to(query.dtype).transpose(1, 2)
        block = BACKENDS["cpu_flash"]  # padding other than on the left, key spans over positions that skip: the tiled kernel
    if block is windows.bands:
        if key_padding is None and not needs_grad and all(part.key_span is None and part.pairs is None for part in parts):
            return _windowed(query, key, value, parts, inv_freq, scaling, sliding_window, positions).to(query.dtype).transpose(1, 2)
        block = BACKENDS["cuda_efficient"]  # padding, key spans, per-head pairs, gradients: the tiled kernel
    if needs_grad and block is flex.part_attention and query.device.type != "cuda":
        raise ValueError(f"backend='flex' has no backward on {query.device.type} (PyTorch's FlexAttention has one on CUDA only): "
                         "use backend='auto' or 'math' to compute gradients here")
    # backends without a backward of their own run on tiles, differentiated by math_backward (O(tile * n) memory)
    whole_blocks = block is not math_block and not (needs_grad and block not in BACKWARDS)

    geometry = (batch, q_len, kv_len, query.dtype, str(query.device), tile, whole_blocks, block)
    if block is fused.parts_attention:
        out = _fused(query, key, value, parts, inv_freq, scaling, key_padding, sliding_window, positions, memo, geometry)
        return out.to(query.dtype).transpose(1, 2)
    if block is flex.part_attention and q_len > SMALL_QUERY and all(part.pairs is None for part in parts):
        out = _one_launch(query, key, value, parts, inv_freq, scaling, key_padding, sliding_window, positions, memo, geometry)
        return out.to(query.dtype).transpose(1, 2)
    q_positions = positions[:, offset:]
    if block is flex.part_attention:
        padded = 0  # flex masks padding itself
    else:
        padded = memo.get("padded keys", (), geometry, lambda: padded_keys(key_padding, q_len, kv_len))
    if q_len <= SMALL_QUERY:
        parts = memo.get("folded parts", (parts,), geometry, lambda: fold_block_key_shifts(parts, positions))
    plans, inputs, moved_keys = [], [], {}
    for part in parts:
        lo, hi = part.min_distance, upper_bound(part, sliding_window)
        if hi is not None and hi <= lo:
            continue
        plan = memo.get("plan", (part,), (*geometry, hi), lambda lo=lo, hi=hi, part=part: _plan(
            part, lo, hi, block, whole_blocks, q_len, kv_len, offset, key_padding, padded, positions, tile, query), keep=_small)
        if not plan:  # no pair of the part here (a decoding step's other chunks): nothing to move
            continue
        if augment and part.pairs is not None:
            q, k = augmented(query, key, part, q_positions, positions, inv_freq)
        else:
            q = shifted(query, part.query_shift, q_positions, inv_freq, part.pairs, _angles(memo, "query", part.query_shift, q_positions,
                                                                                            inv_freq, query.dtype, geometry))
            if (k := moved_keys.get((id(part.key_shift), id(part.pairs)))) is None:  # parts sharing a key shift (DCA's three) rotate once
                k = _keys_moved(key, part.key_shift, part.pairs, positions, inv_freq, memo, geometry, None if needs_grad else kept_keys)
                moved_keys[id(part.key_shift), id(part.pairs)] = k
        plans.append(plan)
        inputs += [q, k]
    if not inputs:  # the model's sliding window excludes every part, or no part reaches a key
        return torch.zeros(batch, q_len, q_heads, value.shape[-1], dtype=query.dtype, device=query.device)
    if needs_grad and block is not flex.part_attention:  # FlexAttention differentiates itself
        out, _ = PartsAttention.apply(plans, block, scaling, value, *inputs)
    else:
        out, _ = run(plans, block, scaling, value, inputs)
    return out.to(query.dtype).transpose(1, 2)


def _one_launch(query, key, value, parts, inv_freq, scaling, key_padding, sliding_window, positions, memo, geometry) -> torch.Tensor:
    """Every part in ONE FlexAttention launch over queries and keys laid side by side (:func:`.flex.segmented_block_mask`).

    A part whose query shift is a constant moves its keys instead (RoPE's rotations add: ``(i + s_q) - (j + s_k) =
    i - (j + s_k - s_q)``), so parts that move by constants share the plain queries and meet in one softmax, no
    merge: STRING is the query against ``[K | K_far]``, ``K_far`` turned by ``S - W``, V used twice. A part whose
    query shift depends on the position (ReRoPE, Self-Extend, DCA) has its own query segment against its keys'
    segment; a query segment's rows are a softmax of their own, merged with the others' by log-sum-exp.
    Returns ``[B, Hq, Lq, D]`` in the accumulation dtype.
    """
    batch, q_len, kv_len = query.shape[0], query.shape[2], key.shape[2]
    offset = kv_len - q_len
    q_positions = positions[:, offset:]
    queries, keys, cells = {}, {}, []
    for part in parts:
        lo, hi = part.min_distance, upper_bound(part, sliding_window)
        if hi is not None and hi <= lo:
            continue
        moving_query = callable(part.query_shift)
        q_id = id(part.query_shift) if moving_query else None
        if q_id not in queries:
            angles = _angles(memo, "query", part.query_shift, q_positions, inv_freq, query.dtype, geometry)
            queries[q_id] = shifted(query, part.query_shift, q_positions, inv_freq, None, angles) if moving_query else query
        k_id = (id(part.key_shift), 0.0 if moving_query else float(part.query_shift))
        if k_id not in keys:
            angles = _angles(memo, "key", part.key_shift, positions, inv_freq, key.dtype, geometry)
            moved = shifted_keys(key, part.key_shift, positions, inv_freq, None, angles)
            keys[k_id] = moved if moving_query else shifted(moved, -part.query_shift, None, inv_freq)
        span = None if part.key_span is None else (*part.key_span(q_positions), positions)
        cells.append((list(queries).index(q_id), list(keys).index(k_id), flex.Region(lo, hi, offset, key_padding, span)))
    accumulate = compute_dtype(query.dtype)
    if not cells:  # the model's sliding window excludes every part
        return torch.zeros(batch, query.shape[1], q_len, value.shape[-1], dtype=accumulate, device=query.device)
    mask = memo.get("one launch", tuple(parts), (*geometry, sliding_window),
                    lambda: flex.segmented_block_mask(cells, len(queries), len(keys), q_len, kv_len, query.device))
    q_segment, kv_segment = flex.segment_length(q_len), flex.segment_length(kv_len)
    out, lse = flex.part_attention(_side_by_side(list(queries.values()), q_segment), _side_by_side(list(keys.values()), kv_segment),
                                   _side_by_side([value] * len(keys), kv_segment), mask, False, scaling)
    merged, merged_lse = out[:, :, :q_len], lse[:, :, :q_len]
    for index in range(1, len(queries)):
        rows = slice(index * q_segment, index * q_segment + q_len)
        merged, merged_lse = merge(merged, merged_lse, out[:, :, rows], lse[:, :, rows])
    return merged.to(accumulate)


def _windowed(query, key, value, parts, inv_freq, scaling, sliding_window, positions) -> torch.Tensor:
    """Each part one FlashAttention call with a window (:mod:`.windows`), on the query and keys its shifts move."""
    q_positions = positions[:, key.shape[2] - query.shape[2]:]
    calls = []
    for part in parts:
        lo, hi = part.min_distance, upper_bound(part, sliding_window)
        if hi is None or hi > lo:
            calls.append((shifted(query, part.query_shift, q_positions, inv_freq), shifted_keys(key, part.key_shift, positions, inv_freq), lo, hi))
    if not calls:  # the model's sliding window excludes every part
        return torch.zeros(*query.shape[:3], value.shape[-1], dtype=torch.float32, device=query.device)
    (out, lse), *others = windows.bands(calls, value, scaling)
    for part_out, part_lse in others:
        out, lse = merge(out, lse, part_out, part_lse)
    return out


def _fused(query, key, value, parts, inv_freq, scaling, key_padding, sliding_window, positions, memo, geometry) -> torch.Tensor:
    """Every part in one pass of the Triton kernel (:mod:`.fused`): a part's query moved on the host (by its query
    shift less a constant key shift), a per-token key shift turned inside the kernel from its angle table.
    Returns ``[B, Hq, Lq, D]`` in the accumulation dtype."""
    batch, q_len, kv_len = query.shape[0], query.shape[2], key.shape[2]
    offset = kv_len - q_len
    q_positions = positions[:, offset:]
    queries, cells, tables, spans = [], [], {}, []
    for part in parts:
        lo, hi = part.min_distance, upper_bound(part, sliding_window)
        if hi is not None and hi <= lo:
            continue
        angles = _angles(memo, "query", part.query_shift, q_positions, inv_freq, query.dtype, geometry)
        q = shifted(query, part.query_shift, q_positions, inv_freq, None, angles)
        table = None
        if callable(part.key_shift):
            if id(part.key_shift) not in tables:
                tables[id(part.key_shift)] = _angles(memo, "key", part.key_shift, positions, inv_freq, key.dtype, geometry)
            table = list(tables).index(id(part.key_shift))
        elif part.key_shift:
            q = shifted(q, -part.key_shift, None, inv_freq)  # rotations add: the key's constant shift moves the query back
        queries.append(q)
        cells.append(fused.Cell(lo, hi, table, part.key_span is not None))
        spans.append(None if part.key_span is None else part.key_span(q_positions))
    if not cells:  # the model's sliding window excludes every part
        return torch.zeros(batch, query.shape[1], q_len, value.shape[-1], dtype=compute_dtype(query.dtype), device=query.device)
    cos_sin = None
    if tables:
        cos_sin = tuple(torch.stack([angles[side][:, 0] for angles in tables.values()]) for side in (0, 1))
    key_spans = None
    if any(span is not None for span in spans):
        everything = torch.iinfo(torch.int64)
        fill = lambda value: torch.full((batch, q_len), value, dtype=torch.int64, device=query.device)
        first = torch.stack([fill(everything.min) if span is None else span[0].expand(batch, q_len) for span in spans])
        stop = torch.stack([fill(everything.max) if span is None else span[1].expand(batch, q_len) for span in spans])
        key_spans = (first, stop, positions)
    out, _ = fused.parts_attention(queries, key, value, cells, scaling, offset, key_padding, cos_sin, key_spans)
    return out


def _side_by_side(tensors: list[torch.Tensor], segment: int) -> torch.Tensor:
    """``[B, H, L, D]`` tensors along dimension 2, each in a segment of ``segment`` positions (zeros after it)."""
    if len(tensors) == 1 and tensors[0].shape[2] == segment:
        return tensors[0]
    first = tensors[0]
    out = first.new_zeros(first.shape[0], first.shape[1], len(tensors) * segment, first.shape[-1])
    for index, tensor in enumerate(tensors):
        out[:, :, index * segment : index * segment + tensor.shape[2]] = tensor
    return out


def _plan(part, lo, hi, block, whole_blocks, q_len, kv_len, offset, key_padding, padded, positions, tile, query) -> list[Block]:
    """The calls that cover ``part``'s pairs ``lo <= i - j < hi``: one over every key with the part's block
    mask for FlexAttention, else the tiles of :func:`.plan.blocks`."""
    q_positions = positions[:, offset:]
    if block is flex.part_attention:
        span = None if part.key_span is None else (*part.key_span(q_positions), positions)
        region = flex.Region(lo, hi, offset, key_padding, span)
        return [Block(slice(0, q_len), slice(0, kv_len), region.block_mask(query.shape[0], q_len, kv_len, query.device))]
    structured = whole_blocks and part.key_span is None and q_len > SMALL_QUERY
    span = None if part.key_span is None else (part.key_span, positions)
    return list(blocks(q_len, kv_len, lo, hi, offset, key_padding, padded, span, tile, structured, query.dtype, query.device))


def _small(plan: list[Block]) -> bool:
    """Whether a plan's additive masks are small enough to hold for a whole forward pass."""
    held = sum(b.mask.numel() for b in plan if isinstance(b.mask, torch.Tensor))
    return held <= MAX_HELD_MASK_ELEMENTS


def _angles(memo: Memo, side: str, shift, positions, inv_freq, dtype, geometry):
    """``(cos, sin)`` of a shift, once per forward pass (``None`` for no shift): of a constant, or of a per-token
    shift at ``positions``; a key shift's come from :data:`.shifts.KEY_ROTATIONS`, which a decoding step extends."""
    compute = compute_dtype(dtype)
    if not callable(shift):
        return memo.get("constant angles", (inv_freq,), (shift, compute, str(positions.device)),
                        lambda: rotation(shift, inv_freq, compute, positions.device)) if shift else None
    if side == "key":
        return memo.get("key angles", (shift, inv_freq), geometry, lambda: KEY_ROTATIONS.get(shift, positions, inv_freq, compute))
    return memo.get("query angles", (shift, inv_freq), geometry, lambda: shift_angles(shift, positions, inv_freq, compute))


def _keys_moved(key, shift, pairs, positions, inv_freq, memo: Memo, geometry, kept_keys: MovedKeys | None) -> torch.Tensor:
    """The keys moved by a part's key shift: kept across decoding steps by ``kept_keys`` for a per-token shift of every
    pair, else rotated with the forward pass's angles (:func:`_angles`)."""
    if kept_keys is not None and callable(shift) and pairs is None:
        return kept_keys.get(shift, key, positions, inv_freq)
    return shifted_keys(key, shift, positions, inv_freq, pairs, _angles(memo, "key", shift, positions, inv_freq, key.dtype, geometry))


def first_dropping_row(drop: torch.Tensor) -> int | None:
    """The first query row whose rate in ``drop [B, Lq]`` is above 0 in some sequence, or ``None`` (reads the device)."""
    rows = (drop > 0).any(0).nonzero()
    return int(rows[0]) if len(rows) else None


def _attention_with_drop(query, key, value, parts, inv_freq, drop, first, common, backend, tile):
    """Rows before ``first``, the first dropping one, take the fast path (DDA drops only beyond the window);
    the rest are computed whole, a tile at a time (:func:`.rows.dropped_attention`)."""
    offset = key.shape[2] - query.shape[2]
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

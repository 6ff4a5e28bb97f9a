"""One attention kernel for every position method: parts in, attention out.

A method is a set of disjoint :class:`~.parts.Part` s (pairs ``lo <= i - j < hi``, with query and key position
shifts). The kernel lowers them to cells (:mod:`.cells`), picks a backend (:mod:`.backends`: ``auto`` or a name),
has it lay out what the positions decide once per forward pass (:meth:`.backends.base.Backend.prepare`, held in a
:class:`.memo.Memo`) and run. A backend that declines a call hands it to its ``fallback``; a backend ``auto`` chose
that fails to compile is given up with one warning, and the call computed again. Drop Attention needs whole rows:
:mod:`.whole_rows` computes them a tile of queries at a time. A part may move some rotary pairs only, per query head
(DPE): where query heads sharing a key/value head move different pairs, prefill repeats keys and values per query
head and decoding puts the moved and the plain keys side by side (:func:`.shifts.augmented`).

Queries are the last ``Lq`` of the ``Lkv`` keys (prefill: ``Lq = Lkv``; decode: ``Lq = 1`` against
the whole KV cache), so the distance of query row ``t`` to key ``j`` is ``t + Lkv - Lq - j``; with
left padding this index distance equals the position distance of every real token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import whole_rows
from .backends import REGISTRY, pick
from .backends.base import Backend, nothing_attended
from .call import Call
from .cells import Cell, lower
from .heads import expand_heads
from .memo import Memo
from .parts import Part
from .plan import SMALL_QUERY
from .rotary import compute_dtype
from .shifts import MovedKeys, fold_block_key_shifts, pairs_split_groups, prepare


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
    ``logit_scale`` (a number, or one per sequence ``[B]``) multiplies the rotary part of the logits.
    ``positions [B, Lkv]``: the keys' absolute positions, for parts whose shifts or spans depend on them (default
    ``0 .. Lkv-1``; the queries are the last ``Lq``). ``drop [B, Lq]``: Drop Attention rates per query (see
    :func:`.whole_rows.drop_below_quantile`); rows from the first dropping one on are computed whole, a tile
    at a time. Grouped-query attention when ``Hq`` is a multiple of ``Hkv``. Accumulates in float32;
    returns ``[B, Lq, Hq, D]`` in the input dtype. Rows that attend no key are 0.

    ``memo``: a :class:`.memo.Memo` shared by the calls of one forward pass (the same positions, padding
    and parts in every call): what depends on those alone -- plans, block masks, shift angles -- is
    built by the first call and reused by the others. Where ``auto`` chose FlexAttention or the fused Triton
    kernel and compiling it fails, the call is computed by the tiled kernel with one warning
    (:func:`.backends.flex.give_up`, :func:`.backends.triton.give_up`), never an error.

    ``kept_keys``: this layer's :class:`.shifts.MovedKeys`, which keeps the keys moved by per-token key shifts
    across decoding steps (the tiled kernel; the fused kernel turns keys as it reads them).
    """
    q_heads, q_len, kv_len = query.shape[1], query.shape[2], key.shape[2]
    if q_len > kv_len:
        raise ValueError(f"query length {q_len} exceeds key length {kv_len}: queries must be the last keys")
    if q_heads % key.shape[1]:
        raise ValueError(f"query heads ({q_heads}) must be a multiple of key/value heads ({key.shape[1]})")
    parts = tuple(parts)
    memo = Memo() if memo is None else memo
    # the first row that drops a score: a host sync, once per forward pass (the memo holds ``drop``, which the
    # layers share)
    first_dropping = (
        None if drop is None else memo.get("first dropping row", (drop,), (), lambda: first_dropping_row(drop))
    )
    dropping = first_dropping is not None
    split = pairs_split_groups(parts, key.shape[1], q_heads)
    if split and (q_len > SMALL_QUERY or dropping):
        key, value = expand_heads(key, q_heads), expand_heads(value, q_heads)  # prefill: as DPE's official code
    if dropping:
        common = dict(
            scaling=scaling,
            key_padding=key_padding,
            sliding_window=sliding_window,
            logit_scale=logit_scale,
            positions=positions,
        )
        return _attention_with_drop(query, key, value, parts, inv_freq, drop, first_dropping, common, backend, tile)
    query, key, scaling, positions = prepare(query, key, inv_freq, scaling, logit_scale, positions)
    augment = split and key.shape[1] < q_heads  # decoding: two key sets side by side, see augmented
    call = Call(
        query,
        key,
        value,
        parts,
        inv_freq,
        scaling,
        positions,
        memo,
        key_padding=key_padding,
        sliding_window=sliding_window,
        tile=tile,
        kept_keys=kept_keys,
        augment=augment,
    )
    try:
        out, _ = _run(pick(query, backend, fusable=call.fusable, needs_grad=call.needs_grad), call)
    except Exception as error:
        failed = next((b for b in REGISTRY.values() if b.compile_failed(error)), None)
        if backend != "auto" or failed is None:
            raise
        failed.give_up(error)  # auto no longer takes it: picked again, the call goes to the next backend
        out, _ = _run(pick(query, backend, fusable=call.fusable, needs_grad=call.needs_grad), call)
    return out.to(query.dtype).transpose(1, 2)


def _run(backend: Backend, call: Call) -> tuple[torch.Tensor, torch.Tensor]:
    """The call's cells by ``backend``, or by its fallback where it declines them: ``(out, lse)``."""
    cells = _cells(backend, call)
    if not cells:  # the model's sliding window excludes every part
        return nothing_attended(call)
    objects = (*cells, call.positions, call.inv_freq, *(() if call.key_padding is None else (call.key_padding,)))
    prepared = call.memo.get(
        backend.name,
        objects,
        (*call.geometry, call.sliding_window),
        lambda: backend.prepare(cells, call),
        keep=backend.keep,
    )
    if prepared is None:
        return _run(_handed_on(backend, call), call)
    return backend.run(prepared, cells, call)


def _handed_on(backend: Backend, call: Call) -> Backend:
    """Who computes a call ``backend`` declines: its declared fallback, else the next backend of the registry that
    wants the call (``math`` takes anything)."""
    if backend.fallback is not None:
        return REGISTRY[backend.fallback]
    names = list(REGISTRY)
    later = [REGISTRY[name] for name in names[names.index(backend.name) + 1 :]]
    return next((b for b in later if b.wants(call.query, call.fusable)), REGISTRY["math"])


def _cells(backend: Backend, call: Call) -> tuple[Cell, ...]:
    """The call's parts lowered (:func:`.cells.lower`), once per forward pass; a decoding step turns DCA's per-chunk key
    shifts into per-chunk queries first where the backend moves keys in memory
    (:func:`.shifts.fold_block_key_shifts`)."""
    fold = backend.folds_block_key_shifts and call.q_len <= SMALL_QUERY

    def lowered():
        parts = fold_block_key_shifts(call.parts, call.positions) if fold else call.parts
        return lower(parts, call.sliding_window)

    return call.memo.get("cells", call.parts, (fold, call.sliding_window, *call.geometry), lowered)


def first_dropping_row(drop: torch.Tensor) -> int | None:
    """The first query row whose rate in ``drop [B, Lq]`` is above 0 in some sequence, or ``None`` (reads the
    device)."""
    rows = (drop > 0).any(0).nonzero()
    return int(rows[0]) if len(rows) else None


def _attention_with_drop(query, key, value, parts, inv_freq, drop, first, common, backend, tile):
    """Rows before ``first``, the first dropping one, take the fast path (DDA drops only beyond the window);
    the rest are computed whole, a tile at a time (:func:`.whole_rows.dropped_attention`)."""
    offset = key.shape[2] - query.shape[2]
    accumulate = compute_dtype(query.dtype)
    pieces = []
    if first:
        keep = offset + first
        head = {
            **common,
            "key_padding": None if common["key_padding"] is None else common["key_padding"][:, :keep],
            "positions": None if common["positions"] is None else common["positions"][:, :keep],
        }
        out = attention(
            query[:, :, :first],
            key[:, :, :keep],
            value[:, :, :keep],
            parts,
            inv_freq,
            backend=backend,
            tile=tile,
            **head,
        )
        pieces.append(out.transpose(1, 2).to(accumulate))
    indices = torch.arange(offset + first, key.shape[2], device=query.device)
    pieces.append(
        whole_rows.dropped_attention(
            query[:, :, first:], key, value, parts, inv_freq, indices, drop[:, first:], **common
        )
    )
    return torch.cat(pieces, dim=2).to(query.dtype).transpose(1, 2)

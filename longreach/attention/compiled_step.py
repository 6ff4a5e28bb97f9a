"""Decoding with no host synchronisation and no data-dependent shape: one step compiles whole.

The tiled kernel (:mod:`.kernel`) reads the lengths, the padding and the parts' key ranges on the host to
call a backend on just the keys a part reaches. Under ``torch.compile(fullgraph=True)`` -- and so for CUDA
graphs, ``mode="reduce-overhead"`` -- a decoding step must not: here every slot of the cache (a
``StaticCache`` keeps empty ones) is scored for every part, each part's pairs are chosen by a mask computed
on the device from the keys' positions, and the chosen scores meet in one softmax. The parts are disjoint
and cover the causal pairs (every method's ``parts``; the tests check it), so this is exactly the method's
attention. The scores are ``[B, Hq, Lq, Lkv]`` for the few queries of a step: O(n) memory, as SDPA's own
decoding. Where Triton runs, the step calls the fused kernel instead, registered as an operator
(:data:`.backends.triton.launch.key_splits`): it reads each slot's position from the device and the cache once, in its
own dtype; the moved queries, the key angles and the combine of its key splits are torch operations for
Inductor to fuse around it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .backends import triton as fused
from .backends.triton import launch
from .cells import lower
from .heads import expand_heads, grouped_matmul
from .parts import NEG_INF, Part, covers
from .rotary import compute_dtype
from .shifts import per_sequence, shift_angles, shifted
from .whole_rows import threshold_rank

EMPTY = -2  # a static cache's empty slot, as the transformers integration marks it


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    parts: Sequence[Part],
    inv_freq: torch.Tensor,
    positions: torch.Tensor,
    scaling: float | None = None,
    sliding_window: int | None = None,
    logit_scale: float | torch.Tensor = 1.0,
    drop: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Attention of rotated ``query [B, Hq, Lq, D]`` over every cache slot ``key``/``value [B, Hkv, Lkv, D]``.

    ``positions [B, Lkv]``: each slot's absolute position, negative where it holds no token (padding, or a
    static cache's empty slot). The queries are the last ``Lq`` slots that are not empty (marked -2), i.e.
    the tokens just written. ``drop [B, Lq]``: Drop Attention's rates (:func:`drop_below_quantile`).
    ``backend``: ``auto`` or ``triton`` take the fused Triton kernel where it can run (:func:`_fused`), any other
    name the scores below. Returns ``[B, Lq, Hq, D]`` in the input dtype; rows that attend no key are 0.
    """
    batch, q_heads, q_len, _ = query.shape
    scaling = 1.0 / math.sqrt(query.shape[-1]) if scaling is None else scaling
    cells = lower(parts, sliding_window)
    if backend in ("auto", "triton") and drop is None and fused.takes_compiled_step(query, cells):
        return _fused(query, key, value, cells, inv_freq, positions, scaling, logit_scale)
    if any(
        part.pairs is not None for part in parts
    ):  # DPE: keys per query head (checking which groups differ would sync)
        key, value = expand_heads(key, q_heads), expand_heads(value, q_heads)
    compute = compute_dtype(query.dtype)
    q_positions = query_positions(positions, q_len)
    real = positions >= 0
    distance = q_positions[:, :, None] - positions[:, None, :]  # [B, Lq, Lkv]
    factor = per_sequence(logit_scale, compute, query.device)
    rotary_dims = 2 * inv_freq.shape[-1]
    scores = torch.full((batch, q_heads, q_len, key.shape[2]), NEG_INF, dtype=compute, device=query.device)
    for cell in cells:
        part = cell.part
        span = cell.span(q_positions)
        span = None if span is None else (span[0][:, :, None], span[1][:, :, None])
        allowed = covers(distance, cell.lo, cell.hi, real[:, None, :], positions[:, None, :], span)  # [B, Lq, Lkv]
        q = _moved(query, part.query_shift, q_positions, inv_freq, part.pairs, compute)  # [B, Hq, Lq, D]
        k = _moved(key, part.key_shift, positions.clamp(min=0), inv_freq, part.pairs, compute)  # [B, Hkv, Lkv, D]
        q = torch.cat((q[..., :rotary_dims] * factor, q[..., rotary_dims:]), dim=-1)
        part_scores = grouped_matmul(q, k.transpose(-1, -2)) * scaling  # [B, Hq, Lq, Lkv]
        scores = torch.where(allowed[:, None], part_scores, scores)
    if drop is not None:
        scores = drop_below_quantile(scores, drop)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)  # [B, Hq, Lq, 1]
    weights = torch.exp(scores - torch.where(torch.isfinite(lse), lse, 0.0))
    out = grouped_matmul(weights, value.to(compute))
    return out.to(query.dtype).transpose(1, 2)


def _fused(query, key, value, cells, inv_freq, positions, scaling, logit_scale) -> torch.Tensor:
    """The step by the fused Triton kernel, called as an operator (:data:`.backends.triton.launch.key_splits`):
    distances from the slots' positions, empty slots and padding masked by them, key angles and moved queries computed
    here for Inductor to fuse (and to compute once for the layers that share them)."""
    dtype, compute = query.dtype, compute_dtype(query.dtype)
    q_positions = query_positions(positions, query.shape[2])
    if isinstance(logit_scale, torch.Tensor) or logit_scale != 1.0:  # on the rotary dimensions, in the compute dtype
        rotary_dims = 2 * inv_freq.shape[-1]
        factor = per_sequence(logit_scale, compute, query.device)
        query = torch.cat((query[..., :rotary_dims] * factor, query[..., rotary_dims:].to(compute)), dim=-1)
    layout = fused.lay_out(
        cells,
        q_positions,
        inv_freq,
        compute,
        lambda shift: shift_angles(shift, positions.clamp(min=0), inv_freq, compute),
    )
    out, _ = launch.parts_attention(
        fused.cell_queries(layout, query),
        key,
        value,
        layout.slots,
        scaling,
        0,
        positions >= 0,
        layout.tables,
        layout.spans,
        positions,
        q_positions,
        launcher=launch.key_splits,
    )
    return out.to(dtype).transpose(1, 2)


def query_positions(positions: torch.Tensor, q_len: int) -> torch.Tensor:
    """``[B, Lq]``: the positions of the last ``q_len`` slots that hold a token (not marked -2, empty), the queries."""
    written = (positions != EMPTY).sum(-1, keepdim=True)  # [B, 1]
    return positions.gather(1, written - q_len + torch.arange(q_len, device=positions.device))


def drop_below_quantile(scores: torch.Tensor, rates: torch.Tensor) -> torch.Tensor:
    """Drop Attention on whole rows ``[B, H, Lq, Lkv]`` (-inf where not attendable), as
    :func:`.whole_rows.drop_below_quantile` decides it -- scores below the order statistic ``s_k``, ``k = ceil(rate (m -
    1))`` of a row's ``m`` attendable scores, become -inf -- with a sort in place of a selection whose size the
    host would have to know."""
    attendable = torch.isfinite(scores[:, :1]).sum(-1, keepdim=True)  # [B, 1, Lq, 1]: the same keys for every head
    rank = threshold_rank(rates[:, None, :, None], attendable)
    ordered = scores.masked_fill(torch.isneginf(scores), float("inf")).sort(dim=-1).values  # unattendable last
    threshold = ordered.gather(-1, rank.expand(*scores.shape[:-1], 1))
    return scores.masked_fill(scores < threshold, NEG_INF)


def _moved(x, shift, positions, inv_freq, pairs, compute):
    """``x`` in the compute dtype moved by the part's shift at ``positions`` (angles computed here, never cached:
    a cache keyed on the host would be a synchronisation)."""
    x = x.to(compute)
    angles = shift_angles(shift, positions, inv_freq, compute) if callable(shift) else None
    return shifted(x, shift, positions, inv_freq, pairs, angles)

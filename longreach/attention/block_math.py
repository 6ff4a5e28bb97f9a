"""One block of attention written out in PyTorch ops, forward and backward: the math backend's blocks
(:mod:`.backends.math`), and the backward of every tiled backend without one of its own (:mod:`.autograd`)."""

from __future__ import annotations

import torch

from .heads import grouped_matmul, per_kv_head
from .parts import NEG_INF
from .rotary import compute_dtype


def block(q, k, v, mask, causal, scaling):
    """One block's softmax attention ``(out, lse)`` in float32 (float64 for float64 inputs)."""
    compute = compute_dtype(q.dtype)
    scores = _scores(q, k, mask, causal, scaling, compute)  # [B, Hq, T, K]
    lse = torch.logsumexp(scores, dim=-1)  # [B, Hq, T]
    weights = torch.exp(scores - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    return grouped_matmul(weights, v.to(compute)), lse


def backward(grad_out, q, k, v, out, lse, mask, causal, scaling):
    """The attention backward written out (Dao et al. 2022, FlashAttention, Algorithm 4), for one tile:
    ``P = exp(S - lse)``, ``dV = P^T dO``, ``dS = P * (dO V^T - rowsum(dO * O))``, ``dQ = dS K s``, ``dK = dS^T Q s``.
    With grouped-query attention, ``dK`` and ``dV`` sum over the query heads sharing a key/value head."""
    compute = out.dtype
    q, k, v = q.to(compute), k.to(compute), v.to(compute)
    p = torch.exp(_scores(q, k, mask, causal, scaling, compute) - lse[..., None])  # [B, Hq, T, K]
    grad_scores = p * (grouped_matmul(grad_out, v.transpose(-1, -2)) - (grad_out * out).sum(-1, keepdim=True))
    grad_q = grouped_matmul(grad_scores, k) * scaling  # [B, Hq, T, D]
    grad_k = per_kv_head(grad_scores.transpose(-1, -2) @ q, k.shape[1]) * scaling  # [B, Hkv, K, D]
    grad_v = per_kv_head(p.transpose(-1, -2) @ grad_out, k.shape[1])  # [B, Hkv, K, Dv]
    return grad_q, grad_k, grad_v


def _scores(q, k, mask, causal, scaling, compute: torch.dtype) -> torch.Tensor:
    """One block's scores ``[B, Hq, T, K]`` in ``compute``: ``q k^T`` times ``scaling``, with a top-left causal and/or
    additive mask."""
    scores = grouped_matmul(q.to(compute), k.to(compute).transpose(-1, -2)) * scaling
    if causal:
        above = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(above, NEG_INF)
    if mask is not None:
        scores = scores + mask.to(compute)
    return scores

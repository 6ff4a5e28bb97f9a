"""The dense oracle: attention with RoPE applied at per-pair relative positions. Tests only.

For each (query i, key j) the score is RoPE's ``<R(P[i, j]) q_i, k_j>`` with ``P`` the method's
relative-position matrix (its paper's rule, :meth:`~longreach.methods.base.PositionMethod.relative_positions`;
every rule side by side in docs/methods.md), computed from *unrotated* q and k. It builds
O(n^2 * D) tensors on purpose -- it is the slow, obvious definition the kernel is checked against
-- and shares no code with :mod:`longreach.attention.rotary` or the kernel.
"""

from __future__ import annotations

import math
from typing import Literal, overload

import torch


def _half_turn(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    angle = positions.to(torch.float64)[..., None] * inv_freq.to(torch.float64)
    angle = torch.cat((angle, angle), dim=-1)
    return angle.cos(), angle.sin()


def unrotate(
    x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float = 1.0
) -> torch.Tensor:
    """Undo RoPE: ``x [B, H, L, D]`` was rotated at ``positions [B, L]`` with cos/sin times ``attention_scaling``."""
    rot = 2 * inv_freq.shape[-1]
    cos, sin = _cos_sin(-positions[:, None, :], inv_freq)
    head = x[..., :rot].to(torch.float64)
    head = (head * cos + _half_turn(head) * sin) / attention_scaling
    return torch.cat((head, x[..., rot:].to(torch.float64)), dim=-1)


@overload
def dense_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    relative_positions: torch.Tensor,
    inv_freq: torch.Tensor,
    scaling: float,
    attention_scaling: float = 1.0,
    key_padding: torch.Tensor | None = None,
    logit_scale: float | torch.Tensor = 1.0,
    drop_rates: torch.Tensor | None = None,
    return_weights: Literal[False] = False,
) -> torch.Tensor: ...


@overload
def dense_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    relative_positions: torch.Tensor,
    inv_freq: torch.Tensor,
    scaling: float,
    attention_scaling: float = 1.0,
    key_padding: torch.Tensor | None = None,
    logit_scale: float | torch.Tensor = 1.0,
    drop_rates: torch.Tensor | None = None,
    *,
    return_weights: Literal[True],
) -> tuple[torch.Tensor, torch.Tensor]: ...


def dense_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    relative_positions: torch.Tensor,
    inv_freq: torch.Tensor,
    scaling: float,
    attention_scaling: float = 1.0,
    key_padding: torch.Tensor | None = None,
    logit_scale: float | torch.Tensor = 1.0,
    drop_rates: torch.Tensor | None = None,
    return_weights: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of unrotated ``query [B, Hq, Lq, D]`` over ``key``/``value [B, Hkv, Lkv, D]`` in float64.

    ``relative_positions [B or 1, Lq, Lkv]``: RoPE's position per pair, NaN where not attended; or
    ``[B or 1, Hq or 1, Lq, Lkv, G]``: one position per head and per group of ``D_rot / (2 G)``
    consecutive rotary pairs (DPE), NaN (in every group) where not attended.
    ``key_padding [B, Lkv]``: False for padding keys. ``attention_scaling`` multiplies cos and sin
    of both q and k as transformers does; ``logit_scale`` (a number, or one per sequence ``[B]``)
    multiplies the rotary part of the logits.
    ``drop_rates [B, Lq]``: Drop Attention -- per row, the attended scores strictly below the
    ``k``-th smallest one, ``k = ceil(rate * (m - 1))`` of ``m``, are dropped (what ``torch.quantile``
    puts below the quantile). Returns ``[B, Lq, Hq, D]`` in float64 (and
    the ``[B, Hq, Lq, Lkv]`` weights with ``return_weights``); rows with no attended key are 0.
    """
    q, k, v = (t.to(torch.float64) for t in (query, key, value))
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    rot = 2 * inv_freq.shape[-1]
    P = relative_positions.to(torch.float64)
    if P.dim() == 3:
        P = P[:, None, :, :, None]  # one position for every head and pair
    P = P.repeat_interleave(inv_freq.shape[-1] // P.shape[-1], dim=-1)  # [B, H, Lq, Lkv, pairs]
    attended = ~torch.isnan(P[..., 0])  # [B, H, Lq, Lkv]
    if key_padding is not None:
        attended = attended & key_padding[:, None, None, :]
    angle = torch.nan_to_num(P) * inv_freq.to(torch.float64)
    cos, sin = torch.cat((angle, angle), dim=-1).cos(), torch.cat((angle, angle), dim=-1).sin()  # [B, H, Lq, Lkv, rot]
    q_head = q[..., :rot][:, :, :, None, :]  # [B, H, Lq, 1, rot]
    q_pair = (q_head * cos + _half_turn(q_head) * sin) * attention_scaling**2
    rotary_logits = (q_pair * k[..., :rot][:, :, None, :, :]).sum(-1)
    plain_logits = q[..., rot:] @ k[..., rot:].transpose(-1, -2)
    factor = torch.as_tensor(logit_scale, dtype=torch.float64, device=rotary_logits.device)
    factor = factor.view(-1, 1, 1, 1) if factor.dim() else factor  # one per sequence, or one number
    scores = (rotary_logits * factor + plain_logits) * scaling
    scores = scores.masked_fill(~attended, float("-inf"))
    if drop_rates is not None:
        for b, h, i in torch.cartesian_prod(*(torch.arange(n) for n in scores.shape[:3])).tolist():
            row = scores[b, h, i]
            attended_scores = row[torch.isfinite(row)]
            if attended_scores.numel() and drop_rates[b, i] > 0:
                rank = math.ceil(float(drop_rates[b, i]) * (attended_scores.numel() - 1) - 1e-9)
                cut = attended_scores.kthvalue(rank + 1).values
                scores[b, h, i] = row.masked_fill(row < cut, float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    out = (weights @ v).transpose(1, 2)
    return (out, weights) if return_weights else out

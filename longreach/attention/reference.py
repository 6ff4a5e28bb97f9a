"""The dense oracle: attention with RoPE applied at per-pair relative positions. Tests only.

For each (query i, key j) the score is RoPE's ``<R(P[i, j]) q_i, k_j>`` with ``P`` the method's
relative-position matrix (its paper's rule, :meth:`~longreach.methods.base.PositionMethod.relative_positions`;
every rule side by side in docs/methods.md), computed from *unrotated* q and k. It builds
O(n^2 * D) tensors on purpose -- it is the slow, obvious definition the kernel is checked against
-- and shares no code with :mod:`longreach.attention.rotary` or the kernel. It turns each layer's pairs where its
:class:`~longreach.attention.layout.Layout` says they are (``half`` or ``interleaved``, the first or the last
dimensions), in place, where the kernels permute a head's dimensions into one layout first.
"""

from __future__ import annotations

import math
from typing import Literal, overload

import torch

from .layout import Layout


def _pairs(layout: Layout | None, inv_freq: torch.Tensor, head_dim: int) -> tuple[list[int], list[int], list[int]]:
    """The dimensions ``a`` and ``b`` of each rotary pair, and the dimensions that do not rotate (default: ``half``
    pairs over the first ``2 * len(inv_freq)``)."""
    if layout is None:
        layout = Layout(True, head_dim, "half", 0, 2 * inv_freq.shape[-1])
    a, b = layout.pair_indices()
    if len(a) != inv_freq.shape[-1]:
        raise ValueError(f"the layout has {len(a)} rotary pairs, inv_freq {inv_freq.shape[-1]} frequencies")
    rotated = set(a) | set(b)
    return a, b, [i for i in range(head_dim) if i not in rotated]


def unrotate(
    x: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_scaling: float = 1.0,
    layout: Layout | None = None,
) -> torch.Tensor:
    """Undo RoPE: ``x [B, H, L, D]`` was rotated at ``positions [B, L]`` with cos/sin times ``attention_scaling``,
    its pairs laid out as ``layout`` says (a layer without RoPE is returned as it is, in float64)."""
    x = x.to(torch.float64)
    if layout is not None and not layout.rotated:
        return x.clone()
    a, b, _ = _pairs(layout, inv_freq, x.shape[-1])
    angle = -positions.to(torch.float64)[:, None, :, None] * inv_freq.to(torch.float64)
    cos, sin = angle.cos(), angle.sin()
    out = x.clone()
    out[..., a] = (x[..., a] * cos - x[..., b] * sin) / attention_scaling
    out[..., b] = (x[..., b] * cos + x[..., a] * sin) / attention_scaling
    return out


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
    layout: Layout | None = None,
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
    layout: Layout | None = None,
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
    layout: Layout | None = None,
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
    puts below the quantile). ``layout``: where each rotary pair sits in a head (default: ``half`` pairs over the first
    ``2 * len(inv_freq)`` dimensions); a layer without RoPE has no rotary logits at all. Returns ``[B, Lq, Hq, Dv]``
    in float64 (and the ``[B, Hq, Lq, Lkv]`` weights with ``return_weights``); rows with no attended key are 0.
    """
    q, k, v = (t.to(torch.float64) for t in (query, key, value))
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    if layout is not None and not layout.rotated:
        a: list[int] = []
        b: list[int] = []
        plain = list(range(q.shape[-1]))
    else:
        a, b, plain = _pairs(layout, inv_freq, q.shape[-1])
    P = relative_positions.to(torch.float64)
    if P.dim() == 3:
        P = P[:, None, :, :, None]  # one position for every head and pair
    P = P.repeat_interleave(inv_freq.shape[-1] // P.shape[-1], dim=-1)  # [B, H, Lq, Lkv, pairs]
    attended = ~torch.isnan(P[..., 0])  # [B, H, Lq, Lkv]
    if key_padding is not None:
        attended = attended & key_padding[:, None, None, :]
    angle = torch.nan_to_num(P[..., : len(a)]) * inv_freq.to(torch.float64)[: len(a)]
    cos, sin = angle.cos(), angle.sin()  # [B, H, Lq, Lkv, pairs]
    q_a, q_b = q[..., a][:, :, :, None, :], q[..., b][:, :, :, None, :]  # [B, H, Lq, 1, pairs]
    k_a, k_b = k[..., a][:, :, None, :, :], k[..., b][:, :, None, :, :]  # [B, H, 1, Lkv, pairs]
    turned_a, turned_b = q_a * cos - q_b * sin, q_b * cos + q_a * sin
    rotary_logits = (turned_a * k_a + turned_b * k_b).sum(-1) * attention_scaling**2
    plain_logits = q[..., plain] @ k[..., plain].transpose(-1, -2)
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

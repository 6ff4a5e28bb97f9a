"""Grouped-query attention's heads: query heads ``Hq`` share key/value heads ``Hkv`` in groups of ``Hq / Hkv``
(Ainslie et al. 2023, GQA). Products and gradients over the groups, without copying keys where it can be helped."""

from __future__ import annotations

import torch


def expand_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Key/value heads repeated for grouped-query attention (a copy: only for backends without grouped queries)."""
    groups = heads // x.shape[1]
    return x if groups == 1 else x[:, :, None].expand(-1, -1, groups, -1, -1).flatten(1, 2)


def grouped_matmul(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x [B, Hq, T, K] @ y [B, Hkv, K, D]`` with query head ``h`` using key/value head ``h // (Hq / Hkv)``,
    without repeating ``y`` (grouped-query attention by broadcasting)."""
    groups = x.shape[1] // y.shape[1]
    if groups == 1:
        return x @ y
    # a group's query rows stacked: one matmul per key/value head (broadcasting y would copy it per query head)
    rows = x.shape[2]
    stacked = x.unflatten(1, (y.shape[1], groups)).flatten(2, 3)  # [B, Hkv, groups * T, K]
    return (stacked @ y).unflatten(2, (groups, rows)).flatten(1, 2)  # [B, Hq, T, D]


def per_kv_head(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """A gradient per query head ``[B, Hq, K, D]`` summed over each key/value head's group ``[B, Hkv, K, D]``."""
    return grad if grad.shape[1] == kv_heads else grad.unflatten(1, (kv_heads, -1)).sum(2)

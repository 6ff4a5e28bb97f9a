"""Moving already-rotated queries and keys to other RoPE positions.

RoPE (Su et al. 2021, Eq. 34) rotates each pair of dimensions ``(x_k, x_{k+D/2})`` (transformers'
``rotate_half`` layout) by the angle ``position * inv_freq[k]``. Rotations add, so a vector rotated
at position ``i`` is moved to ``i + delta`` by a pure rotation of angle ``delta * inv_freq``. The
model's ``attention_scaling`` (YaRN, LongRoPE) is already in the vector and must not be applied
again, so the cos and sin here are unscaled. With partial rotary (Phi-3, ``partial_rotary_factor``)
only the first ``2 * len(inv_freq)`` dimensions rotate.
"""

from __future__ import annotations

import torch
from torch import nn


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate(x: torch.Tensor, delta: float | torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [..., L, D]`` by ``delta`` positions (a number, or a tensor broadcastable to ``[..., L]``).

    The rotation runs in float32 (float64 for float64 inputs) and is cast back to ``x.dtype``.
    """
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    rotary_dims = 2 * inv_freq.shape[-1]
    delta = torch.as_tensor(delta, dtype=compute, device=x.device)
    angle = delta[..., None] * inv_freq.to(device=x.device, dtype=compute)
    angle = torch.cat((angle, angle), dim=-1)
    head = x[..., :rotary_dims].to(compute)
    moved = (head * angle.cos() + rotate_half(head) * angle.sin()).to(x.dtype)
    if rotary_dims == x.shape[-1]:
        return moved
    return torch.cat((moved, x[..., rotary_dims:]), dim=-1)


def inverse_frequencies(rotary: nn.Module, layer_type: str | None = None) -> torch.Tensor:
    """The rotary module's current ``inv_freq`` (per layer type on Gemma 3), read at call time.

    Read on every call: dynamic NTK scaling replaces ``inv_freq`` during the forward pass.
    """
    if layer_type is not None and hasattr(rotary, f"{layer_type}_inv_freq"):
        return getattr(rotary, f"{layer_type}_inv_freq")
    return rotary.inv_freq


def find_rotary(model: nn.Module) -> nn.Module | None:
    """The model's rotary embedding module (``model.model.rotary_emb`` on decoder-only models)."""
    for _, module in model.named_modules():
        if module.__class__.__name__.endswith("RotaryEmbedding") and any(
            name == "inv_freq" or name.endswith("_inv_freq") for name, _ in module.named_buffers()
        ):
            return module
    return None

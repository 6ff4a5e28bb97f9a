"""Moving already-rotated queries and keys to other RoPE positions.

RoPE (Su et al. 2021, Eq. 34) rotates each pair of dimensions ``(x_k, x_{k+D/2})`` (transformers'
``rotate_half`` layout) by the angle ``position * inv_freq[k]``. Rotations add, so a vector rotated
at position ``i`` is moved to ``i + delta`` by a pure rotation of angle ``delta * inv_freq``. The
model's ``attention_scaling`` (YaRN, LongRoPE) is already in the vector and must not be applied
again, so the cos and sin here are unscaled. With partial rotary (Phi-3, ``partial_rotary_factor``)
only the first ``2 * len(inv_freq)`` dimensions rotate.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn


def rotate(x: torch.Tensor, delta: float | torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [..., L, D]`` by ``delta`` positions (a number, or a tensor broadcastable to ``[..., L]``).

    The rotation runs in float32 (float64 for float64 inputs) and is cast back to ``x.dtype``.
    """
    return apply_rotation(x, *rotation(delta, inv_freq, compute_dtype(x.dtype), x.device))


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Rotations of float64 vectors run in float64, all others in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def rotation(
    delta: float | torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype, device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` of the angles ``delta * inv_freq``: ``[..., L, D_rot / 2]`` for ``delta [..., L]``."""
    delta = torch.as_tensor(delta, dtype=dtype, device=device)
    angle = delta[..., None] * inv_freq.to(device=device, dtype=dtype)
    return angle.cos(), angle.sin()


def apply_rotation(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the pairs ``(x_k, x_{k + D_rot/2})`` of ``x`` by the angles whose ``cos`` and ``sin`` are given:
    ``(x1 cos - x2 sin, x2 cos + x1 sin)``, i.e. ``x cos + rotate_half(x) sin`` without building ``rotate_half``."""
    half = cos.shape[-1]
    x1, x2 = x[..., :half].to(cos.dtype), x[..., half : 2 * half].to(cos.dtype)
    if (torch.is_grad_enabled() and x.requires_grad) or torch.compiler.is_compiling():  # out= has no autograd, nor a
        # compiled graph (views as out=): the same formula, out of place
        first, second = torch.addcmul(x1 * cos, x2, sin, value=-1), torch.addcmul(x2 * cos, x1, sin)
        # the unrotated tail (partial rotary) widened as the angles widen the halves (DCA's per-chunk queries)
        rest = [x[..., 2 * half :].to(cos.dtype).expand(*first.shape[:-1], -1)] if 2 * half < x.shape[-1] else []
        return torch.cat([first, second, *rest], dim=-1).to(x.dtype)
    lead, angles = x.shape[:-1], cos.shape[:-1]
    # not strict: broadcasting matches the trailing dimensions; x's leading ones past the angles' stay as they are
    if len(angles) > len(lead) or any(a not in (1, b) for a, b in zip(reversed(angles), reversed(lead), strict=False)):
        lead = torch.broadcast_shapes(lead, angles)  # the angles widen x (a Python function: slow, so only then)
    shape = lead + x.shape[-1:]
    moved = torch.empty(shape, dtype=cos.dtype, device=x.device)  # written in place: no temporaries, no concatenation
    first, second = moved[..., :half], moved[..., half : 2 * half]
    torch.mul(x1, cos, out=first).addcmul_(x2, sin, value=-1)
    torch.mul(x2, cos, out=second).addcmul_(x1, sin)
    moved[..., 2 * half :] = x[..., 2 * half :]
    return moved.to(x.dtype)


def inverse_frequencies(rotary: nn.Module, layer_type: str | None = None) -> torch.Tensor:
    """The rotary module's current ``inv_freq`` (per layer type on Gemma 3), read at call time.

    Read on every call: dynamic NTK scaling replaces ``inv_freq`` during the forward pass.
    """
    if layer_type is not None and hasattr(rotary, f"{layer_type}_inv_freq"):
        return getattr(rotary, f"{layer_type}_inv_freq")
    return cast(torch.Tensor, rotary.inv_freq)  # a buffer (nn.Module's __getattr__ says Tensor | Module)


def rotary_pairs(rotary: nn.Module) -> int:
    """How many rotary pairs each head has: the length of the module's ``inv_freq`` (any layer type's)."""
    return next(
        buffer for name, buffer in rotary.named_buffers() if name == "inv_freq" or name.endswith("_inv_freq")
    ).shape[-1]

"""``cpu_flash``: PyTorch's CPU flash attention on the tiled kernel's blocks, with its backward.

``auto`` takes it on the CPU where the C++ kernel (:mod:`.cpu_fused`) cannot compute the call: gradients, DPE's
per-head pairs, under ``torch.compile``, or where that kernel cannot be built.
"""

from __future__ import annotations

import torch

from ... import compat
from ..heads import expand_heads, per_kv_head
from ..rotary import compute_dtype
from .tiled import TiledBackend


def rows_contiguous(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors with each row's elements adjacent (a copy of those whose last dimension has a stride): PyTorch's
    CPU flash attention reads them as adjacent whatever the stride says (torch 2.13: a key cache whose blocks store
    keys transposed, vLLM's, gave wrong scores, with no error)."""
    return tuple(t if t.stride(-1) == 1 else t.contiguous() for t in tensors)


def block(q, k, v, mask, causal, scaling):
    """PyTorch's CPU flash attention, which also returns the log-sum-exp (grouped-query natively where the
    release can, :func:`~longreach.compat.cpu_flash_takes_grouped_heads`; else keys and values repeated per head)."""
    q, k, v = rows_contiguous(q, k, v)
    if not compat.cpu_flash_takes_grouped_heads():
        k, v = expand_heads(k, q.shape[1]), expand_heads(v, q.shape[1])
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, is_causal=causal, attn_mask=mask, scale=scaling
    )
    return out.float(), lse


def backward(grad_out, q, k, v, out, lse, mask, causal, scaling):
    """PyTorch's CPU flash-attention backward, given the merged output and log-sum-exp (grouped-query natively,
    or on keys and values repeated per head and their gradients summed back, as :func:`block`)."""
    dtype, kv_heads = q.dtype, k.shape[1]
    grad_out, q, k, v = rows_contiguous(grad_out, q, k, v)
    if not compat.cpu_flash_takes_grouped_heads():
        k, v = expand_heads(k, q.shape[1]), expand_heads(v, q.shape[1])
    grad_q, grad_k, grad_v = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out.to(dtype),
        q,
        k,
        v,
        out.to(dtype),
        lse.to(compute_dtype(dtype)),
        0.0,
        causal,
        attn_mask=mask,
        scale=scaling,
    )
    return tuple(g.to(out.dtype) for g in (grad_q, per_kv_head(grad_k, kv_heads), per_kv_head(grad_v, kv_heads)))


class CpuFlash(TiledBackend):
    name = "cpu_flash"
    summary = "PyTorch's CPU flash attention on the tiled kernel's blocks; with gradients"
    model_devices = ("cpu", "meta")
    has_backward = True

    def wants(self, query, fusable) -> bool:
        return query.device.type == "cpu"

    def block(self, q, k, v, mask, causal, scaling):
        return block(q, k, v, mask, causal, scaling)

    def backward(self, grad_out, q, k, v, out, lse, mask, causal, scaling):
        return backward(grad_out, q, k, v, out, lse, mask, causal, scaling)


BACKEND = CpuFlash()

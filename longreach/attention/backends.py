"""Backends: one block of attention with its log-sum-exp, and the backward of those that have one.

A backend is ``(q, k, v, mask, causal, scaling) -> (out, lse)`` for one :class:`~.plan.Block`
(``mask``: an additive tensor, or a FlexAttention block mask for :mod:`.flex`). Adding one means
writing it here and naming it in :data:`BACKENDS`.
"""

from __future__ import annotations

from typing import Callable

import torch

from .. import compat
from . import flex, fused, native, windows
from .plan import NEG_INF, SMALL_QUERY
from .rotary import compute_dtype


def cpu_flash(q, k, v, mask, causal, scaling):
    """PyTorch's CPU flash attention, which also returns the log-sum-exp (grouped-query natively where the
    release can, :func:`~longreach.compat.cpu_flash_takes_grouped_heads`; else keys and values repeated per head)."""
    if not compat.cpu_flash_takes_grouped_heads():
        k, v = expand_heads(k, q.shape[1]), expand_heads(v, q.shape[1])
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=causal, attn_mask=mask, scale=scaling)
    return out.float(), lse


def cuda_efficient(q, k, v, mask, causal, scaling):
    """PyTorch's memory-efficient CUDA attention, which returns the log-sum-exp when asked.

    It has no grouped-query attention: the block's keys and values are repeated per query head.
    """
    k, v = expand_heads(k, q.shape[1]), expand_heads(v, q.shape[1])
    if mask is not None:
        mask = aligned_rows(mask).expand(q.shape[0], q.shape[1], -1, -1)
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, mask, True, 0.0, causal, scale=scaling
    )
    return out.float(), lse[..., : q.shape[2]].float()


def aligned_rows(mask: torch.Tensor) -> torch.Tensor:
    """``mask`` with 16-byte aligned rows: the memory-efficient kernel refuses a bias whose row stride is not a
    multiple of 16 bytes or whose start is not aligned ("attn_bias is not correctly aligned"). Rows are padded
    in memory, not in shape."""
    row = 16 // mask.element_size()
    if mask.stride(-1) == 1 and mask.stride(-2) % row == 0 and mask.data_ptr() % 16 == 0:
        return mask
    keys = mask.shape[-1]
    padded = mask.new_empty(*mask.shape[:-1], -(-keys // row) * row)[..., :keys]
    return padded.copy_(mask)


def math_block(q, k, v, mask, causal, scaling):
    """Plain matmul-softmax in float32 (float64 for float64 inputs): any device, any dtype.

    Only ever called on tiles (the kernel routes it through the tiled path), so memory stays O(n).
    """
    compute = compute_dtype(q.dtype)
    scores = _scores(q, k, mask, causal, scaling, compute)
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    return grouped_matmul(weights, v.to(compute)), lse


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
    rows = x.shape[2]  # a group's query rows stacked: one matmul per key/value head (broadcasting y would copy it per query head)
    return (x.unflatten(1, (y.shape[1], groups)).flatten(2, 3) @ y).unflatten(2, (groups, rows)).flatten(1, 2)


def _scores(q, k, mask, causal, scaling, compute: torch.dtype) -> torch.Tensor:
    """One block's scores in ``compute``: ``q k^T`` times ``scaling``, with a top-left causal and/or additive mask."""
    scores = grouped_matmul(q.to(compute), k.to(compute).transpose(-1, -2)) * scaling
    if causal:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1), NEG_INF)
    if mask is not None:
        scores = scores + mask.to(compute)
    return scores


def cpu_flash_backward(grad_out, q, k, v, out, lse, mask, causal, scaling):
    """PyTorch's CPU flash-attention backward, given the merged output and log-sum-exp (grouped-query natively,
    or on keys and values repeated per head and their gradients summed back, as :func:`cpu_flash`)."""
    dtype, kv_heads = q.dtype, k.shape[1]
    if not compat.cpu_flash_takes_grouped_heads():
        k, v = expand_heads(k, q.shape[1]), expand_heads(v, q.shape[1])
    grad_q, grad_k, grad_v = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out.to(dtype), q, k, v, out.to(dtype), lse.to(compute_dtype(dtype)), 0.0, causal, attn_mask=mask, scale=scaling
    )
    return tuple(g.to(out.dtype) for g in (grad_q, per_kv_head(grad_k, kv_heads), per_kv_head(grad_v, kv_heads)))


def math_backward(grad_out, q, k, v, out, lse, mask, causal, scaling):
    """The attention backward written out (Dao et al. 2022, FlashAttention, Algorithm 4), for one tile:
    ``P = exp(S - lse)``, ``dV = P^T dO``, ``dS = P * (dO V^T - rowsum(dO * O))``, ``dQ = dS K s``, ``dK = dS^T Q s``.
    With grouped-query attention, ``dK`` and ``dV`` sum over the query heads sharing a key/value head."""
    compute = out.dtype
    q, k, v = q.to(compute), k.to(compute), v.to(compute)
    p = torch.exp(_scores(q, k, mask, causal, scaling, compute) - lse[..., None])
    grad_scores = p * (grouped_matmul(grad_out, v.transpose(-1, -2)) - (grad_out * out).sum(-1, keepdim=True))
    return (grouped_matmul(grad_scores, k) * scaling, per_kv_head(grad_scores.transpose(-1, -2) @ q, k.shape[1]) * scaling,
            per_kv_head(p.transpose(-1, -2) @ grad_out, k.shape[1]))


def per_kv_head(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """A gradient per query head ``[B, Hq, K, D]`` summed over each key/value head's group ``[B, Hkv, K, D]``."""
    return grad if grad.shape[1] == kv_heads else grad.unflatten(1, (kv_heads, -1)).sum(2)


BACKENDS: dict[str, Callable] = {"cpu_flash": cpu_flash, "cuda_efficient": cuda_efficient, "flex": flex.part_attention, "math": math_block,
                                 "triton": fused.parts_attention, "cuda_flash": windows.bands, "cpu_fused": native.parts_attention}
"""Each backend by name; ``triton``, ``cuda_flash`` and ``cpu_fused`` take every part at once (the kernel calls them on
all parts, not per block)."""
BACKWARDS: dict[Callable, Callable] = {cpu_flash: cpu_flash_backward, math_block: math_backward}
"""Backends with a backward of their own; the others are differentiated tile by tile with :func:`math_backward`."""


def pick(query: torch.Tensor, backend: str, fusable: bool = False) -> Callable:
    """``auto``: on the CPU the C++ kernel (:mod:`.native`) where the call is ``fusable`` -- no gradients, no
    per-head pairs -- and a compiler is there, else CPU flash attention on tiles; on CUDA compiled FlexAttention
    (memory-efficient attention without Triton), and for a decoding step (at most ``SMALL_QUERY`` queries) the fused
    Triton kernel (:mod:`.fused`, split along the keys) where the call is ``fusable``, else the math backend; the
    math backend in float64 and on other devices."""
    if backend == "auto":
        decoding = query.device.type == "cuda" and query.shape[2] <= SMALL_QUERY
        if query.dtype == torch.float64:
            backend = "math"
        elif decoding:
            backend = "triton" if fusable and fused.available(query.device, for_auto=True) else "math"
        elif query.device.type == "cuda":
            backend = "flex" if flex.available(query.device, for_auto=True) else "cuda_efficient"
        elif query.device.type == "cpu":
            # under torch.compile the tiled kernel, which Dynamo traces (the C++ call would break the graph)
            native_ok = fusable and not torch.compiler.is_compiling() and native.available(query.device, for_auto=True)
            backend = "cpu_fused" if native_ok else "cpu_flash"
        else:
            backend = "math"
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of: auto, {', '.join(BACKENDS)}")
    if backend == "flex" and not flex.available(query.device):
        raise ValueError(f"backend='flex' needs PyTorch's FlexAttention (torch >= 2.5, and Triton on CUDA); not available on {query.device}")
    if backend == "triton" and not fused.available(query.device):
        raise ValueError(f"backend='triton' needs Triton on a CUDA device, or TRITON_INTERPRET=1 on the CPU; not available on {query.device}")
    if backend == "triton" and not fused.takes(query.dtype):
        raise ValueError(f"backend='triton' with float64 inputs needs Triton >= 3.5 (its tl.dot takes no float64 before; "
                         f"{fused.triton.__version__} is installed): give float32, or use backend='auto'")
    if backend == "cuda_flash" and not windows.available(query):
        raise ValueError(f"backend='cuda_flash' needs PyTorch's FlashAttention: a CUDA device and float16 or bfloat16 inputs "
                         f"(head dim <= 256); got {query.device.type} {str(query.dtype).removeprefix('torch.')}")
    if backend == "cpu_fused" and not native.available(query.device):
        raise ValueError(f"backend='cpu_fused' needs a CPU tensor and a C++ compiler (CXX or c++ on PATH); got {query.device.type}")
    if backend in ("triton", "cpu_fused") and not fusable:
        raise ValueError(f"backend={backend!r} computes no gradients and no per-head rotary pairs (DPE): use backend='auto' here")
    return BACKENDS[backend]


def block_for(block: Callable, q: torch.Tensor, value: torch.Tensor) -> Callable:
    """The backend for a part: the chosen one, or the math backend where query and key are wider than the
    value (DPE's side-by-side keys, :func:`augmented`), which the flash kernels refuse and FlexAttention takes."""
    return block if q.shape[-1] == value.shape[-1] or block is flex.part_attention else math_block

"""``cuda_efficient``: PyTorch's memory-efficient CUDA attention on the tiled kernel's blocks.

``auto`` takes it for prefill on CUDA where FlexAttention cannot run (no Triton, or compiling it failed). It has no
backward of its own: under autograd its blocks are tiles, differentiated by the math backward (:mod:`..autograd`).
"""

from __future__ import annotations

import torch

from ..heads import expand_heads
from ..plan import SMALL_QUERY
from .tiled import TiledBackend


def block(q, k, v, mask, causal, scaling):
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


class CudaEfficient(TiledBackend):
    name = "cuda_efficient"
    summary = "PyTorch's memory-efficient CUDA attention on the tiled kernel's blocks"
    model_devices = ("cuda",)

    def wants(self, query, fusable) -> bool:
        return query.device.type == "cuda" and query.shape[2] > SMALL_QUERY

    def block(self, q, k, v, mask, causal, scaling):
        return block(q, k, v, mask, causal, scaling)


BACKEND = CudaEfficient()

"""``math``: plain matmul-softmax in float32 (float64 for float64 inputs), on any device, with its backward.

Only ever called on tiles (its blocks are never whole: :meth:`.tiled.TiledBackend.whole_blocks`), so memory stays
O(n). ``auto`` takes it for float64 inputs, on devices other than the CPU and CUDA, and for a CUDA decoding step the
fused kernel cannot compute.
"""

from __future__ import annotations

from ..block_math import backward, block
from .tiled import TiledBackend


class Math(TiledBackend):
    name = "math"
    summary = "matmul-softmax on tiles, float32 (float64 for float64 inputs); any device, with gradients"

    def wants(self, query, fusable) -> bool:
        return True

    has_backward = True

    def whole_blocks(self, call) -> bool:
        return False

    def block(self, q, k, v, mask, causal, scaling):
        return block(q, k, v, mask, causal, scaling)

    def backward(self, grad_out, q, k, v, out, lse, mask, causal, scaling):
        return backward(grad_out, q, k, v, out, lse, mask, causal, scaling)


BACKEND = Math()

"""The parts' attention with an exact backward, for backends without one of their own."""

from __future__ import annotations

import torch

from .block_math import backward as math_backward
from .merge import run


class PartsAttention(torch.autograd.Function):
    """The parts' attention with an exact backward.

    The merged output is one softmax over all keys, each scored in its part, so the gradient of
    every block is the flash-attention backward evaluated with the *merged* output and
    log-sum-exp (as split-KV flash attention does): ``P = exp(S - lse)``,
    ``dS = P * (dO V^T - rowsum(dO * O))``. The backward replays the same blocks.
    """

    @staticmethod
    def forward(ctx, plans, backend, scaling, value, *shifted):
        out, lse = run(plans, backend, scaling, value, shifted)
        ctx.save_for_backward(value, out, lse, *shifted)
        ctx.plans, ctx.scaling = plans, scaling
        ctx.backward = backend.backward if backend.has_backward else math_backward
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _):
        value, out, lse, *shifted = ctx.saved_tensors
        lse = lse.masked_fill(torch.isneginf(lse), float("inf"))  # rows that attend nothing: P = 0
        accumulate = out.dtype
        grad_value = torch.zeros(value.shape, dtype=accumulate, device=value.device)
        grads = [torch.zeros(t.shape, dtype=accumulate, device=t.device) for t in shifted]
        for index, plan in enumerate(ctx.plans):
            q, k = shifted[2 * index], shifted[2 * index + 1]
            grad_q, grad_k = grads[2 * index], grads[2 * index + 1]
            backward = ctx.backward if q.shape[-1] == value.shape[-1] else math_backward
            for b in plan:
                dq, dk, dv = _block_backward(backward, b, grad_out, q, k, value, out, lse, ctx.scaling)
                grad_q[:, :, b.rows] += dq
                grad_k[:, :, b.keys] += dk
                grad_value[:, :, b.keys] += dv
        grads_in_dtypes = (g.to(t.dtype) for g, t in zip(grads, shifted, strict=True))
        return (None, None, None, grad_value.to(value.dtype), *grads_in_dtypes)


def _block_backward(backward, b, grad_out, q, k, value, out, lse, scaling):
    """``(dq, dk, dv)`` of one block's rows and keys; a flipped block (:attr:`.plan.Block.flipped`) is
    differentiated as the causal call it ran as, and its gradients are turned back."""
    rows = (grad_out[:, :, b.rows], q[:, :, b.rows], out[:, :, b.rows])
    keys = (k[:, :, b.keys], value[:, :, b.keys])
    if not b.flipped:
        return backward(rows[0], rows[1], *keys, rows[2], lse[:, :, b.rows], b.mask, b.causal, scaling)
    grad_out, q, out = (t.flip(2) for t in rows)
    k, value = (t.flip(2) for t in keys)
    grads = backward(grad_out, q, k, value, out, lse[:, :, b.rows].flip(-1), None, True, scaling)
    return tuple(g.flip(2) for g in grads)

"""Running a plan: every part's blocks, merged by their log-sum-exp (docs/how-it-works.md)::

O = (exp(lse_a) O_a + exp(lse_b) O_b) / (exp(lse_a) + exp(lse_b))
"""

from __future__ import annotations

import torch

from .parts import NEG_INF
from .rotary import compute_dtype


def merge(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two softmax attentions over disjoint key sets by their log-sum-exp, stably.

    The weight of ``a`` is ``exp(lse_a) / (exp(lse_a) + exp(lse_b)) = sigmoid(lse_a - lse_b)``,
    computed from the difference so that large log-sum-exps lose no precision. A row empty in one
    part (lse = -inf) takes the other part as it is; empty in both, it stays 0.
    """
    both_empty = torch.isneginf(lse_a) & torch.isneginf(lse_b)
    weight_a = torch.sigmoid(torch.where(both_empty, 0.0, lse_a - lse_b))
    weight_a, weight_b = (torch.where(both_empty, 0.0, w)[..., None] for w in (weight_a, 1 - weight_a))
    return out_a * weight_a + out_b.to(out_a.dtype) * weight_b, torch.logaddexp(lse_a, lse_b)


def merge_into(out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor) -> None:
    """:func:`merge` written into ``out`` and ``lse`` (views of the running result): the weights are a softmax of
    the two log-sum-exps (max-subtracted: large ones lose no precision; both empty: NaN, set to 0), two passes over
    the output and no new tensor of its size, seven operations in all (no autograd: the forward of a backend
    without one)."""
    both = torch.stack((lse, part_lse.to(lse.dtype)))  # [2, B, H, T]
    weights = torch.softmax(both, dim=0).nan_to_num_(nan=0.0)[..., None]  # [2, B, H, T, 1]
    out.mul_(weights[0]).addcmul_(part_out, weights[1])
    lse.copy_(torch.logsumexp(both, dim=0))


def run(plans, backend, scaling, value, shifted):
    """Every part's blocks, merged by log-sum-exp: ``(out, lse)`` in the accumulation dtype.

    Rows that no earlier block reached take a block's result as it is; the others merge with it, in place
    where nothing is differentiated through this function."""
    q0 = shifted[0]
    batch, heads, q_len = q0.shape[:3]
    accumulate = compute_dtype(q0.dtype)
    in_place = not (torch.is_grad_enabled() and any(x.requires_grad for x in (value, *shifted)))

    def nothing_attended():
        return (
            torch.zeros(batch, heads, q_len, value.shape[-1], dtype=accumulate, device=q0.device),
            torch.full((batch, heads, q_len), NEG_INF, dtype=accumulate, device=q0.device),
        )

    # allocated at the first block that covers only some rows; a whole first block is taken as it is
    out: torch.Tensor | None = None
    lse: torch.Tensor | None = None
    reached: list[tuple[int, int]] = []  # the row ranges some block has reached
    for plan, q, k in zip(plans, shifted[0::2], shifted[1::2], strict=True):
        call = backend.block_for(q, value)
        for b in plan:
            part_out, part_lse = run_block(call, b, q, k, value, scaling)  # [B, Hq, T, Dv], [B, Hq, T]
            if isinstance(b.mask, torch.Tensor):
                part_out, part_lse = with_empty_rows(part_out, part_lse, b.mask)
            rows = range(q_len)[b.rows]
            if out is None or lse is None:  # (both or neither)
                if len(rows) == q_len:
                    out, lse = part_out.to(accumulate), part_lse.to(accumulate)
                else:
                    out, lse = nothing_attended()
                    out[:, :, b.rows], lse[:, :, b.rows] = part_out, part_lse
            elif not in_place and len(rows) == q_len:  # FlexAttention's autograd keeps its outputs: merged out of place
                out, lse = merge(out, lse, part_out, part_lse)
            elif not in_place:
                out[:, :, b.rows], lse[:, :, b.rows] = merge(out[:, :, b.rows], lse[:, :, b.rows], part_out, part_lse)
            elif any(rows.start < stop and start < rows.stop for start, stop in reached):
                merge_into(out[:, :, b.rows], lse[:, :, b.rows], part_out, part_lse)
            else:  # rows no block has reached yet
                out[:, :, b.rows], lse[:, :, b.rows] = part_out, part_lse
            reached.append((rows.start, rows.stop))
    return (out, lse) if out is not None else nothing_attended()  # no part reaches any key


def with_empty_rows(out, lse, mask):
    """Mark rows whose mask hides every key as empty (lse = -inf): backends may report 0 there. On an
    accelerator always (asking whether any row is empty would wait for the device); on the CPU only when one is."""
    empty = torch.isneginf(mask).all(-1)
    if lse.device.type != "cpu" or bool(empty.any()):
        lse = lse.masked_fill(empty.expand_as(lse), NEG_INF)
    return out, lse


def run_block(call, b, q, k, value, scaling):
    """One block by the backend ``call``: ``(out, lse)`` of its rows; a flipped block runs causal on the
    rows and keys reversed, and its rows are turned back."""
    q, k, value = (
        q[:, :, b.rows],
        k[:, :, b.keys],
        value[:, :, b.keys],
    )  # [B, Hq, T, D], [B, Hkv, K, D], [B, Hkv, K, Dv]
    if not b.flipped:
        return call(q, k, value, b.mask, b.causal, scaling)
    out, lse = call(q.flip(2), k.flip(2), value.flip(2), None, True, scaling)
    return out.flip(2), lse.flip(-1)

"""A toy backend in one file, as docs/how-it-works.md's walk-through writes one: every cell's scores over all keys,
its pairs chosen by the one rule (:func:`longreach.attention.parts.covers`), one softmax. O(n^2): a test's, never
a user's. tests/test_backends.py registers it with one line and checks that apply, pick and the errors know it."""

from __future__ import annotations

import torch

from longreach.attention.backends.base import Backend
from longreach.attention.heads import grouped_matmul
from longreach.attention.parts import NEG_INF, covers
from longreach.attention.shifts import shifted, shifted_keys


class Toy(Backend):
    name = "toy"
    summary = "every cell's scores over every key, one softmax (a test's backend)"
    model_devices = ("cpu", "meta")

    def unavailable(self, query):
        return None if query.device.type == "cpu" else f"backend='toy' runs on the CPU only; got {query.device.type}"

    def refuses(self, query, fusable, needs_grad):
        return "backend='toy' computes no gradients" if needs_grad else None

    def prepare(self, cells, call):
        """Each cell's pairs ``[B, 1, Lq, Lkv]``: what the positions and padding alone decide."""
        rows = torch.arange(call.offset, call.kv_len)[:, None]
        distance = rows - torch.arange(call.kv_len)[None, :]  # [Lq, Lkv]
        real = None if call.key_padding is None else call.key_padding[:, None, None, :]
        masks = []
        for cell in cells:
            span = cell.span(call.q_positions)
            bounds = None if span is None else (span[0][:, None, :, None], span[1][:, None, :, None])
            masks.append(covers(distance, cell.lo, cell.hi, real, call.positions[:, None, None, :], bounds))
        return masks

    def run(self, masks, cells, call):
        scores = torch.full((*call.query.shape[:3], call.kv_len), NEG_INF)  # [B, Hq, Lq, Lkv]
        for cell, mask in zip(cells, masks, strict=True):
            q = shifted(call.query, cell.query_shift, call.q_positions, call.inv_freq).float()
            k = shifted_keys(call.key, cell.key_shift, call.positions, call.inv_freq).float()
            scores = torch.where(mask, grouped_matmul(q, k.transpose(-1, -2)) * call.scaling, scores)
        lse = torch.logsumexp(scores, -1)
        weights = torch.exp(scores - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
        return grouped_matmul(weights, call.value.float()), lse


BACKEND = Toy()

"""Dual Chunk Attention, DCA (An et al. 2024, "Training-Free Long-Context Scaling of Large Language
Models", arXiv:2402.17463, section 3; ChunkLlama).

The sequence is cut into chunks of ``c = s - l`` tokens (chunk size ``s``, local window ``l``) and
every key sits at ``j mod c``. The query's position depends on where the key is::

    same chunk:       P = (i mod c) - (j mod c)                    (= i - j)
    previous chunk:   P = min(i mod c + c, s) - (j mod c)
    earlier chunks:   P = min(2c - 1, s) - (j mod c)

This follows the official ChunkLlama code (``chunkllama_attn_replace.py``), whose earlier-chunk
query sits at ``min(2c - 1, s)``; that is ``s`` itself whenever ``s >= 2l + 1`` (always
with the defaults). ``mscale=True`` reproduces the official code's length-dependent temperature:
once a sequence of ``n`` tokens is longer than ``L``, cos and sin are multiplied by
``0.05 ln(n / L) + 1``, so the rotary logits by its square (``get_mscale`` in
``chunkllama_attn_replace.py``, with ``n`` the tokens so far, cache included). The paper's defaults are ``s = 3L/4``;
the local window is ``L/8``, as in the official code since April 2024 (``L/16`` before). Three parts,
one per chunk relation, with per-token shifts and chunk-aligned key spans.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Part, PositionMethod, causal_distance, require_bool, require_int


@dataclass(frozen=True)
class DualChunk(PositionMethod):
    """Dual Chunk Attention (An et al. 2024): keys at ``j mod c`` (``c = s - l``), queries by chunk relation.

    Args:
        training_window: the model's ``L``.
        chunk_size: ``s``, an integer > ``l``; default ``3L/4``.
        local_window: ``l``, an integer with ``0 < l < s``; default ``L/8`` (the official code's since 2024-04,
            ``L/16`` before).
        mscale: the official code's temperature: cos and sin multiplied by ``0.05 ln(n / L) + 1`` once a
            sequence has ``n > L`` tokens; off by default.
    """

    name = "dca"
    paper = "An et al. 2024, Training-Free Long-Context Scaling of LLMs (DCA, arXiv:2402.17463)"
    changes = "positions: keys at j mod c; queries by chunk relation (same, previous, earlier)"
    ranges = {
        "chunk_size": "integer > local_window (default 3L/4)",
        "local_window": "integer, 0 < local_window < chunk_size (default L/8)",
        "mscale": "True/False: official (0.05 ln(n/L) + 1) on cos/sin beyond L",
    }

    training_window: int
    chunk_size: int | None = None
    local_window: int | None = None
    mscale: bool = False

    def __post_init__(self) -> None:
        L = self.training_window
        if self.chunk_size is None:
            object.__setattr__(self, "chunk_size", 3 * L // 4)
        if self.local_window is None:
            object.__setattr__(self, "local_window", L // 8)
        require_int("chunk_size", self.chunk_size, 2, None, "chunk_size > local_window > 0")
        require_int(
            "local_window",
            self.local_window,
            1,
            self.chunk_size - 1,
            f"0 < local_window < chunk_size = {self.chunk_size}",
        )
        require_bool("mscale", self.mscale)

    def logit_scale_at(self, sequence_lengths: torch.Tensor) -> float | torch.Tensor:
        """With ``mscale``: ``(0.05 ln(n / L) + 1)^2`` for sequences of ``n > L`` tokens, else 1."""
        if not self.mscale:
            return 1.0
        ratio = sequence_lengths.double() / self.training_window
        return torch.where(ratio > 1, (0.05 * torch.log(ratio.clamp(min=1)) + 1) ** 2, 1.0)

    @property
    def chunk(self) -> int:
        return self.chunk_size - self.local_window

    def parts(self) -> tuple[Part, ...]:
        c, s = self.chunk, self.chunk_size
        inter = min(2 * c - 1, s)

        def start(p):
            return torch.div(p, c, rounding_mode="floor") * c  # first position of p's chunk

        def at_key(p):
            return p % c - p

        def never(p):
            return torch.full_like(p, torch.iinfo(p.dtype).min)

        return (
            Part(0, c, query_shift=at_key, key_shift=at_key, key_span=lambda p: (start(p), p + 1), key_shift_block=c),
            Part(
                1,
                2 * c,
                query_shift=lambda p: torch.clamp(p % c + c, max=s) - p,
                key_shift=at_key,
                key_span=lambda p: (start(p) - c, start(p)),
                key_shift_block=c,
            ),
            Part(
                c + 1,
                None,
                query_shift=lambda p: inter - p,
                key_shift=at_key,
                key_span=lambda p: (never(p), start(p) - c),
                key_shift_block=c,
            ),
        )

    def relative_positions(self, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
        c, s = self.chunk, self.chunk_size
        d = causal_distance(query_positions, key_positions)
        q_chunk = torch.div(query_positions, c, rounding_mode="floor")
        k_chunk = torch.div(key_positions, c, rounding_mode="floor")
        q_mod, k_mod = (query_positions % c).to(torch.float64), (key_positions % c).to(torch.float64)
        previous = torch.clamp(q_mod + c, max=s) - k_mod
        earlier = min(2 * c - 1, s) - k_mod
        P = torch.where(q_chunk == k_chunk, q_mod - k_mod, torch.where(q_chunk == k_chunk + 1, previous, earlier))
        return torch.where(torch.isnan(d), d, P)

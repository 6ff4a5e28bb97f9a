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

Qwen2.5-1M's DCA (Yang et al. 2025, "Qwen2.5-1M Technical Report", arXiv:2501.15383, section 4.1; the
``dual_chunk_attention_config`` of its checkpoints, run by vLLM 0.7-0.10's ``dual_chunk_flash_attn.py`` and
``dual_chunk_rope.py``) has the same positions and key spans: keys at ``j mod c``, queries at ``i mod c``,
``min(i mod c + c, s)`` and ``min(2c - 1, s)``. Its one difference is the temperature, YaRN's (Peng et al. 2023,
Eq. 22) with the scale set by the sequence's length: queries and keys multiplied by
``max(1, 0.1 ln(n / L) + 1)``, ``L`` its ``original_max_position_embeddings``; ``mscale="qwen"`` gives it, as the
logits multiplied by its square (see :meth:`DualChunk.logit_scale_at` for where ``n`` differs from vLLM 0.10's).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Part, PositionMethod, causal_distance, require_int


@dataclass(frozen=True)
class DualChunk(PositionMethod):
    """Dual Chunk Attention (An et al. 2024): keys at ``j mod c`` (``c = s - l``), queries by chunk relation.

    Args:
        training_window: the model's ``L``.
        chunk_size: ``s``, an integer > ``l``; default ``3L/4``.
        local_window: ``l``, an integer with ``0 < l < s``; default ``L/8`` (the official code's since 2024-04,
            ``L/16`` before).
        mscale: a temperature on the rotary logits once a sequence has ``n > L`` tokens: ``True``, the official
            ChunkLlama code's (cos and sin multiplied by ``0.05 ln(n / L) + 1``); ``"qwen"``, Qwen2.5-1M's (queries
            and keys multiplied by ``0.1 ln(n / L) + 1``); off (``False``) by default.
    """

    name = "dca"
    paper = "An et al. 2024, Training-Free Long-Context Scaling of LLMs (DCA, arXiv:2402.17463)"
    changes = "positions: keys at j mod c; queries by chunk relation (same, previous, earlier)"
    ranges = {
        "chunk_size": "integer > local_window (default 3L/4)",
        "local_window": "integer, 0 < local_window < chunk_size (default L/8)",
        "mscale": "False, True (ChunkLlama's 0.05 ln(n/L) + 1 on cos/sin beyond L) or 'qwen' (Qwen2.5-1M's 0.1)",
    }

    training_window: int
    chunk_size: int | None = None
    local_window: int | None = None
    mscale: bool | str = False

    def __post_init__(self) -> None:
        L = self.training_window
        if self.chunk_size is None:
            object.__setattr__(self, "chunk_size", 3 * L // 4)
        if self.local_window is None:
            object.__setattr__(self, "local_window", L // 8)
        assert self.chunk_size is not None and self.local_window is not None  # set above
        require_int("chunk_size", self.chunk_size, 2, None, "chunk_size > local_window > 0")
        require_int(
            "local_window",
            self.local_window,
            1,
            self.chunk_size - 1,
            f"0 < local_window < chunk_size = {self.chunk_size}",
        )
        if not isinstance(self.mscale, bool) and self.mscale != "qwen":
            raise ValueError(f"mscale must be True, False or 'qwen', got {self.mscale!r}")

    def logit_scale_at(self, sequence_lengths: torch.Tensor) -> float | torch.Tensor:
        """With ``mscale``: ``(a ln(n / L) + 1)^2`` for sequences of ``n > L`` tokens, else 1; ``a`` is 0.05
        (ChunkLlama) or 0.1 (``"qwen"``).

        ``n`` counts the sequence's tokens so far, a declared prompt whole (:func:`longreach.generation`): a prompt
        read in one forward pass gets Qwen's temperature exactly, queries and keys alike. In decoding, Qwen's vLLM
        0.10 kept each key at the factor of the step that wrote it, where this scales every key by the current one:
        the logits differ by ``f(n) / f(P)`` for a prompt of ``P`` tokens, ``0.1 ln(n / P) / f(P)`` at most
        (7e-5 after 1,000 tokens generated past a 1M-token prompt).
        """
        if not self.mscale:
            return 1.0
        slope = 0.1 if self.mscale == "qwen" else 0.05
        ratio = sequence_lengths.double() / self.training_window
        return torch.where(ratio > 1, (slope * torch.log(ratio.clamp(min=1)) + 1) ** 2, 1.0)

    @property
    def chunk(self) -> int:
        assert self.chunk_size is not None and self.local_window is not None  # set in __post_init__
        return self.chunk_size - self.local_window

    def parts(self) -> tuple[Part, ...]:
        c, s = self.chunk, self.chunk_size
        assert s is not None  # set in __post_init__
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
        assert s is not None  # set in __post_init__
        d = causal_distance(query_positions, key_positions)
        q_chunk = torch.div(query_positions, c, rounding_mode="floor")
        k_chunk = torch.div(key_positions, c, rounding_mode="floor")
        q_mod, k_mod = (query_positions % c).to(torch.float64), (key_positions % c).to(torch.float64)
        previous = torch.clamp(q_mod + c, max=s) - k_mod
        earlier = min(2 * c - 1, s) - k_mod
        P = torch.where(q_chunk == k_chunk, q_mod - k_mod, torch.where(q_chunk == k_chunk + 1, previous, earlier))
        return torch.where(torch.isnan(d), d, P)


def qwen_dual_chunk(dual_chunk_attention_config: dict) -> tuple[dict, int | None]:
    """DCA's parameters and ``L`` for a Qwen2.5-1M checkpoint's ``dual_chunk_attention_config``: its ``chunk_size``
    and ``local_size`` (vLLM 0.10's defaults where absent: 8192 and 1024), and Qwen's temperature with ``L`` its
    ``original_max_position_embeddings`` where it gives one (``None``: none, and no temperature, as in vLLM 0.10).
    Its MInference sparse prefill (``sparse_attention_config``) has no counterpart here: longreach's DCA is dense."""
    original = int(dual_chunk_attention_config.get("original_max_position_embeddings") or 0) or None
    params = {
        "chunk_size": int(dual_chunk_attention_config.get("chunk_size", 8192)),
        "local_window": int(dual_chunk_attention_config.get("local_size", 1024)),
        "mscale": "qwen" if original else False,
    }
    return params, original

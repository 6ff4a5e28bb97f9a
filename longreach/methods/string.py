"""STRING, shifted rotary position embedding (An et al., ICLR 2025, arXiv:2410.18745).

Eq. 4 of the paper, with ``d = i - j``, shift ``S`` and local window ``W``::

    P(i, j) = d            if d < S
              d - S + W    otherwise

Positions ``>= L - S + W`` are never used: the undertrained tail of the position-frequency
distribution is dropped and the frequent positions are reused for distant pairs. Computed as two
disjoint parts (the paper's Algorithm 2): a band ``d < S`` at the original positions, and the
far triangle ``d >= S`` with every query moved back by ``S - W``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .base import Part, PositionMethod, causal_distance, require_bool, require_int

OFFICIAL_MSCALE = 1 + 0.1 * math.log(2)
"""The official STRING code multiplies RoPE's cos and sin by this (YaRN's mscale for factor 2)."""


def default_local_window(training_window: int) -> int:
    """STRING's default ``W`` for a model's ``L``: ``min(128, L // 16)``, at least 1."""
    return max(1, min(128, training_window // 16))


@dataclass(frozen=True)
class String(PositionMethod):
    """STRING (An et al. 2025, Eq. 4): ``P = d`` for ``d < S``, else ``d - S + W``.

    Args:
        training_window: the model's ``L``.
        shift: ``S``, an integer with ``W < S < L``; default ``round(L/3)``.
        local_window: ``W``, an integer with ``0 < W < S``; default ``min(128, L // 16)``: the paper's 128 from
            ``L = 2048`` on (every model it evaluates), and below it a window as small against ``S = L/3`` as 128
            is at 2K (``S/W ~ 5.3``), so that the defaults fit every ``L`` (``L = 256``: ``S = 85``, ``W = 16``).
        mscale: the official code's ``1 + 0.1 ln 2`` factor on cos and sin, i.e. rotary logits multiplied
            by ``(1 + 0.1 ln 2)^2 ~ 1.143``; off by default, as the paper's equation.
    """

    name = "string"
    paper = "An et al. 2025, Why Does the Effective Context Length of LLMs Fall Short? (arXiv:2410.18745)"
    changes = "positions: P = d for d < S, else d - S + W (drops the undertrained tail)"
    ranges = {
        "shift": "integer, local_window < shift < L (default round(L/3))",
        "local_window": "integer, 0 < local_window < shift (default min(128, L // 16))",
        "mscale": "True/False: official 1 + 0.1 ln 2 on cos/sin",
    }

    training_window: int
    shift: int | None = None
    local_window: int | None = None
    mscale: bool = False

    def __post_init__(self) -> None:
        L = self.training_window
        defaulted = self.local_window is None
        if self.shift is None:
            object.__setattr__(self, "shift", round(L / 3))
        if defaulted:
            object.__setattr__(self, "local_window", default_local_window(L))
        require_int("shift", self.shift, 1, L - 1, f"local_window < shift < L = {L}")
        require_int("local_window", self.local_window, 1, None, f"0 < local_window < shift = {self.shift}")
        assert self.shift is not None and self.local_window is not None  # set above
        if not self.local_window < self.shift:
            where = (
                f" (the default at L = {L}, min(128, L // 16): give a smaller local_window, or a larger shift)"
                if defaulted
                else ""
            )
            raise ValueError(
                f"local_window={self.local_window} is out of range: "
                f"0 < local_window < shift = {self.shift} < L = {L}{where}"
            )
        require_bool("mscale", self.mscale)

    def parts(self) -> tuple[Part, ...]:
        S, W = self.shift, self.local_window
        assert S is not None and W is not None  # set in __post_init__
        return (
            Part(min_distance=0, max_distance=S),
            Part(min_distance=S, query_shift=-(S - W)),
        )

    def relative_positions(self, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
        S, W = self.shift, self.local_window
        assert S is not None and W is not None  # set in __post_init__
        d = causal_distance(query_positions, key_positions)
        return torch.where(d < S, d, d - S + W)

    @property
    def logit_scale(self) -> float:
        return OFFICIAL_MSCALE**2 if self.mscale else 1.0

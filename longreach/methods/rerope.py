"""ReRoPE, rectified rotary position embedding (Su 2023, "Rectified Rotary Position Embeddings",
kexue.fm/archives/9708; the STRING paper's baseline).

``P = d`` for ``d < w``, else ``w`` (every distant pair sits at the window's edge). The leaky
variant (Leaky ReRoPE) continues with slope ``1/k`` instead: ``P = w + (d - w) / k``. Two parts:
the band ``d < w``, and the far pairs with the query moved to ``w + i/k - w/k`` and the key to ``j/k``
(``k = inf`` for plain ReRoPE: query at ``w``, key at 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Part, PositionMethod, causal_distance, require_int, require_number


@dataclass(frozen=True)
class ReRope(PositionMethod):
    """ReRoPE (Su 2023): ``P = d`` for ``d < w``, else ``w``; Leaky ReRoPE: ``w + (d - w) / k``.

    Args:
        training_window: the model's ``L``.
        window: ``w``, an integer with ``0 < w <= L``; default ``L/2``.
        leak: ``k > 1`` for Leaky ReRoPE; ``None`` (default) for plain ReRoPE.
    """

    name = "rerope"
    paper = "Su 2023, Rectified Rotary Position Embeddings (ReRoPE)"
    changes = "positions: P = d for d < w, else w (leaky: w + (d - w)/k)"
    ranges = {"window": "integer, 0 < window <= L (default L/2)", "leak": "None or a number > 1"}

    training_window: int
    window: int | None = None
    leak: float | None = None

    def __post_init__(self) -> None:
        if self.window is None:
            object.__setattr__(self, "window", self.training_window // 2)
        require_int("window", self.window, 1, self.training_window, f"0 < window <= L = {self.training_window}")
        if self.leak is not None:
            require_number("leak", self.leak, "a number > 1 (or None for plain ReRoPE)", low=1, low_open=True)

    def parts(self) -> tuple[Part, ...]:
        w, k = self.window, self.leak
        assert w is not None  # set in __post_init__
        if k is None:
            far = Part(w, None, query_shift=lambda p: w - p, key_shift=lambda p: -p)
        else:
            far = Part(w, None, query_shift=lambda p: w - w / k + p / k - p, key_shift=lambda p: p / k - p)
        return (Part(0, w), far)

    def relative_positions(self, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
        w = self.window
        assert w is not None  # set in __post_init__
        d = causal_distance(query_positions, key_positions)
        far = w + (d - w) / self.leak if self.leak else d * 0 + w  # NaN stays NaN
        return torch.where(d < w, d, far)

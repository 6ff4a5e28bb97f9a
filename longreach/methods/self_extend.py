"""Self-Extend (Jin et al. 2024, "LLM Maybe LongLM: Self-Extend LLM Context Window Without Tuning",
arXiv:2401.01325, Eq. 3-4).

Neighbours keep their positions; distant pairs use grouped positions ``floor(pos / G)``, shifted so
that the two regimes meet at the neighbour window::

    P = d                                   if d < W_n
        i // G - j // G + W_n - W_n // G    otherwise

Two parts: the band ``d < W_n``, and the far pairs with the query at ``i // G + W_n - W_n // G``
and the key at ``j // G`` (per-token shifts of the absolute positions).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Part, PositionMethod, causal_distance, require_int


@dataclass(frozen=True)
class SelfExtend(PositionMethod):
    """Self-Extend (Jin et al. 2024): ``P = d`` for ``d < Wn``, else ``i//G - j//G + Wn - Wn//G``.

    Args:
        training_window: the model's ``L``.
        group_size: ``G``, an integer >= 1.
        neighbor_window: ``Wn``, an integer > 0; default ``L/4``.
    """

    name = "self_extend"
    paper = "Jin et al. 2024, LLM Maybe LongLM: Self-Extend (arXiv:2401.01325)"
    changes = "positions: P = d for d < Wn, else i//G - j//G + Wn - Wn//G"
    ranges = {"group_size": "integer >= 1", "neighbor_window": "integer > 0 (default L/4)"}

    training_window: int
    group_size: int = 4
    neighbor_window: int | None = None

    def __post_init__(self) -> None:
        if self.neighbor_window is None:
            object.__setattr__(self, "neighbor_window", self.training_window // 4)
        require_int("group_size", self.group_size, 1, None, "group_size >= 1")
        require_int("neighbor_window", self.neighbor_window, 1, None, "neighbor_window > 0")

    def parts(self) -> tuple[Part, ...]:
        G, W = self.group_size, self.neighbor_window
        assert W is not None  # set in __post_init__
        return (
            Part(0, W),
            Part(
                W,
                None,
                query_shift=lambda p: torch.div(p, G, rounding_mode="floor") + W - W // G - p,
                key_shift=lambda p: torch.div(p, G, rounding_mode="floor") - p,
            ),
        )

    def relative_positions(self, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
        G, W = self.group_size, self.neighbor_window
        assert W is not None  # set in __post_init__
        d = causal_distance(query_positions, key_positions)
        grouped = torch.div(query_positions, G, rounding_mode="floor") - torch.div(
            key_positions, G, rounding_mode="floor"
        )
        return torch.where(d < W, d, d * 0 + grouped + W - W // G)  # d * 0 keeps NaN (not attended)

"""Plain RoPE (Su et al. 2021, RoFormer): ``P = i - j``. The identity method and the baseline."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Part, PositionMethod, causal_distance


@dataclass(frozen=True)
class Rope(PositionMethod):
    """Causal attention at the model's own positions, through longreach's kernel."""

    name = "rope"
    paper = "Su et al. 2021, RoFormer (arXiv:2104.09864)"
    changes = "nothing: P = i - j, through longreach's kernel"
    ranges = {}

    training_window: int

    def parts(self) -> tuple[Part, ...]:
        return (Part(),)

    def relative_positions(self, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
        return causal_distance(query_positions, key_positions)

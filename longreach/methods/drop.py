"""Drop Attention (DA) and Dynamic Drop Attention (DDA) (Dynamic Drop Attention paper, section 3.2-3.3;
``papers/dynamic-drop-attention.txt``).

For a query, over the keys it may attend, the attention scores below the row's ``q``-quantile
(``q`` = the drop rate; what ``torch.quantile`` puts below it) are set to -inf before the softmax.
Ties at the quantile are kept, so the best key always survives. DA uses one rate;
DDA leaves tokens inside the training window alone, splits the tokens beyond it into chunks of
``chunk`` tokens and gives chunk ``k`` the rate ``min(initial_rate + k * step, max_rate)``;
generated tokens (those ``generate`` produced, after the prompt, however the prompt was read) use
``generated_rate`` (the paper found 0 best).
Only the chosen ``layers`` drop (the paper: the first three). Composes with any position or
frequency method.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import require_int, require_number

LAYERS = "layer indices >= 0 (the paper: the first three)"


def _check_rate(name: str, value) -> None:
    require_number(name, value, f"0 <= {name} < 1", low=0)
    if not value < 1:
        raise ValueError(f"{name}={value!r} is out of range: 0 <= {name} < 1")


def _check_layers(layers) -> tuple[int, ...]:
    layers = tuple(layers) if isinstance(layers, (tuple, list)) else (layers,)
    if not layers or any(isinstance(x, bool) or not isinstance(x, numbers.Integral) or x < 0 for x in layers):
        raise ValueError(f"layers={layers!r} is out of range: a non-empty list of layer indices >= 0")
    return tuple(int(x) for x in layers)


def in_model(params: dict, model_layers: int) -> dict:
    """A drop method's parameters for a model of ``model_layers`` layers: the default layers (the paper's first
    three) cut to the model's; layers given must lie in it (a one-line ``ValueError``)."""
    if "layers" not in params:
        return {**params, "layers": tuple(range(min(3, model_layers)))}
    given = _check_layers(params["layers"])
    if max(given) >= model_layers:
        raise ValueError(f"layers={list(given)} is out of range: layer indices 0 .. {model_layers - 1}")
    return params


@dataclass(frozen=True)
class Drop:
    """Drop Attention (DA): every query drops the scores below its ``rate``-quantile.

    Args:
        rate: the quantile, ``0 <= rate < 1``.
        layers: the layers that drop (the paper: the first three).
    """

    kind: ClassVar[str] = "drop"
    name: ClassVar[str] = "drop"
    paper: ClassVar[str] = "Dynamic Drop Attention paper, Drop Attention (DA), Eq. 1"
    changes: ClassVar[str] = (
        "attention: per query, scores below the row's rate-quantile of its attendable scores -> -inf"
    )
    ranges: ClassVar[dict[str, str]] = {"rate": "0 <= rate < 1", "layers": LAYERS}

    rate: float = 0.3
    layers: tuple[int, ...] = (0, 1, 2)

    def __post_init__(self) -> None:
        _check_rate("rate", self.rate)
        object.__setattr__(self, "layers", _check_layers(self.layers))

    def rates(self, positions: torch.Tensor, training_window: int, generated: torch.Tensor | None) -> torch.Tensor:
        """The drop rate of every query ``[B, Lq]`` at absolute ``positions``; ``generated [B, Lq]`` marks the
        generated tokens (``None``: every query is prompt text)."""
        return torch.full(positions.shape, float(self.rate), dtype=torch.float64, device=positions.device)

    def describe(self) -> str:
        return f"drop(rate={self.rate}, layers={list(self.layers)})"


@dataclass(frozen=True)
class DynamicDrop:
    """Dynamic Drop Attention (DDA): no dropping inside the training window, a rate growing chunk by chunk beyond it.

    Args:
        initial_rate: the first chunk's rate beyond the window.
        step: added per chunk.
        max_rate: the largest rate, ``initial_rate <= max_rate < 1``.
        chunk: tokens per chunk.
        generated_rate: the rate of tokens the model generates (the paper found 0 best).
        layers: the layers that drop (the paper: the first three).
    """

    kind: ClassVar[str] = "drop"
    name: ClassVar[str] = "dynamic_drop"
    paper: ClassVar[str] = "Dynamic Drop Attention paper, DDA, Eq. 3 (best: 0.15, +0.05, max 0.3)"
    changes: ClassVar[str] = (
        "attention: as drop, with rate 0 inside the window and "
        "min(initial_rate + k step, max_rate) in chunk k beyond it"
    )
    ranges: ClassVar[dict[str, str]] = {
        "initial_rate": "0 <= initial_rate <= max_rate",
        "step": "step >= 0",
        "max_rate": "initial_rate <= max_rate < 1",
        "chunk": "integer >= 1",
        "generated_rate": "0 <= generated_rate < 1",
        "layers": LAYERS,
    }

    initial_rate: float = 0.15
    step: float = 0.05
    max_rate: float = 0.3
    chunk: int = 1000
    generated_rate: float = 0.0
    layers: tuple[int, ...] = (0, 1, 2)

    def __post_init__(self) -> None:
        for name in ("initial_rate", "max_rate", "generated_rate"):
            _check_rate(name, getattr(self, name))
        require_number("step", self.step, "step >= 0", low=0)
        if self.max_rate < self.initial_rate:
            raise ValueError(
                f"max_rate={self.max_rate} is out of range: initial_rate = {self.initial_rate} <= max_rate < 1"
            )
        require_int("chunk", self.chunk, 1, None, "an integer >= 1")
        object.__setattr__(self, "layers", _check_layers(self.layers))

    def rates(self, positions: torch.Tensor, training_window: int, generated: torch.Tensor | None) -> torch.Tensor:
        chunk = torch.div(positions - training_window, self.chunk, rounding_mode="floor")
        rates = torch.clamp(self.initial_rate + chunk * self.step, max=self.max_rate)
        rates = torch.where(positions >= training_window, rates.double(), 0.0)
        return rates if generated is None else torch.where(generated, float(self.generated_rate), rates)

    def describe(self) -> str:
        return (
            f"dynamic_drop(initial_rate={self.initial_rate}, step={self.step}, max_rate={self.max_rate}, "
            f"chunk={self.chunk}, generated_rate={self.generated_rate}, layers={list(self.layers)})"
        )


METHODS: tuple[type[Drop | DynamicDrop], ...] = (Drop, DynamicDrop)

"""What every position method is made of.

A position method is a rule ``P(i, j)``: the relative position RoPE must see for the query at
position ``i`` and the key at ``j`` (from each method's paper; every rule side by side in
docs/methods.md). It is given twice, and the tests check that both agree:

* :meth:`PositionMethod.parts` -- the efficient form the kernel computes: disjoint regions of
  the causal triangle, each with a position shift for its queries and keys (RoPE rotations add,
  so an already-rotated query moved by ``delta`` sits at ``i + delta``);
* :meth:`PositionMethod.relative_positions` -- the dense ``P`` matrix, written directly from the
  paper's rule, for the O(n^2) reference and for pictures.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import Field, fields
from typing import Any, ClassVar, cast

import torch

from ..attention.parts import Part, Shift  # noqa: F401 (re-exported: the contract methods produce)


class PositionMethod:
    """A position method: a rule ``P(i, j)`` and the parts that compute it.

    Subclasses are frozen dataclasses of their parameters, validated when built. ``parts()`` feeds the
    attention kernel; ``relative_positions`` is the dense rule written from the paper, for the float64
    reference and the pictures.
    """

    __dataclass_fields__: ClassVar[dict[str, Field[Any]]]  # every method is a dataclass (what fields() reads)
    kind: ClassVar[str] = "position"
    name: ClassVar[str]
    paper: ClassVar[str]
    changes: ClassVar[str]
    ranges: ClassVar[dict[str, str]]
    training_window: int  # every method's field: the model's L, which its defaults derive from

    def parts(self) -> tuple[Part, ...]:
        """The disjoint regions of the causal triangle, each with its position shifts, that make up ``P``."""
        raise NotImplementedError

    def relative_positions(self, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
        """Dense ``P`` for broadcastable position tensors; NaN where the pair is not attended."""
        raise NotImplementedError

    def layer_parts(self, layer: int | None) -> tuple[Part, ...]:
        """The parts of attention layer ``layer`` (the same for every layer, but for DPE's per-layer pairs)."""
        return self.parts()

    @property
    def parts_differ_by_layer(self) -> bool:
        """Whether :meth:`layer_parts` gives layers different parts (DPE with selected pairs)."""
        return False

    def layer_positions(
        self, query_positions: torch.Tensor, key_positions: torch.Tensor, layer: int | None
    ) -> torch.Tensor:
        """Dense ``P`` of layer ``layer``: ``[..., Lq, Lkv]``, or ``[B, H, Lq, Lkv, pairs]`` when it differs
        per head and rotary pair (DPE)."""
        return self.relative_positions(query_positions, key_positions)

    def check_model(self, layers: int, query_heads: int, pairs: int) -> None:
        """Raise ``ValueError`` if the method cannot serve a model of this shape (``pairs``: rotary pairs per head)."""

    @property
    def logit_scale(self) -> float:
        """Factor on the logits of the rotary dimensions (1.0: none)."""
        return 1.0

    def logit_scale_at(self, sequence_lengths: torch.Tensor) -> float | torch.Tensor:
        """The logit factor for sequences of ``sequence_lengths [B]`` tokens: a number, or one per sequence."""
        return self.logit_scale

    def saved_params(self) -> dict:
        """The parameters to save with a model (``longreach.load`` applies them again): JSON-able values."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "training_window"}

    def describe(self) -> str:
        """The method with every parameter, e.g. ``string(shift=2731, local_window=128, mscale=False)``."""
        values = ", ".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self) if f.name != "training_window")
        return f"{self.name}({values})" if values else self.name


def causal_distance(query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
    """``d = i - j`` as float64, NaN where ``j > i`` (not attended under causal masking)."""
    distance = (query_positions - key_positions).to(torch.float64)
    return torch.where(distance >= 0, distance, torch.nan)


def require_number(
    name: str, value, rule: str, low: float | None = None, high: float | None = None, low_open: bool = False
) -> None:
    """Raise ``ValueError`` unless ``value`` is a finite real number in range (``low_open``: ``value > low``)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number ({rule}), got {value!r}")
    number = cast(float, value)  # any numbers.Real: mypy does not model the numeric tower (python/mypy#3186)
    if (
        not math.isfinite(number)
        or (low is not None and (number <= low if low_open else number < low))
        or (high is not None and number > high)
    ):
        raise ValueError(f"{name}={value!r} is out of range: {rule}")


def require_bool(name: str, value) -> None:
    """Raise ``ValueError`` unless ``value`` is ``True`` or ``False``."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


LARGEST = 2**31 - 1  # a position, window or size: what a kernel's 32-bit index and torch's int64 products both hold


def require_int(name: str, value, low: int, high: int | None, rule: str) -> None:
    """Raise ``ValueError`` naming the parameter, its value and the allowed range; no bound (``high`` None) is
    :data:`LARGEST` (a larger window or size is accepted nowhere: every forward would overflow)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer ({rule}), got {value!r}")
    number = cast(int, value)  # any numbers.Integral: mypy does not model the numeric tower (python/mypy#3186)
    if number < low or (high is not None and number > high):
        raise ValueError(f"{name}={value} is out of range: {rule}")
    if number > LARGEST:
        raise ValueError(f"{name}={value} is out of range: {rule}, at most {LARGEST}")


def unknown(name, kind: str, choices: list[str]) -> str:
    """The one-line error for a ``kind`` name that is none of ``choices``: the nearest ones first, then all."""
    import difflib

    near = difflib.get_close_matches(str(name), choices, n=2, cutoff=0.6)
    guess = f"did you mean {' or '.join(near)}? " if near else ""
    return f"unknown {kind} {name!r}; {guess}{kind}s: {', '.join(choices)} (`longreach methods` describes them)"

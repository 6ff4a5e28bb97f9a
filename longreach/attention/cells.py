"""The one lowering: a method's parts become the cells every backend computes.

A :class:`~.parts.Part` says which pairs it holds and how it moves queries and keys; a :class:`Cell` is that
part cut to the call -- its distance bounds under the model's sliding window (a part the window excludes has
no cell) -- and the views it reads: the query as the part moves it, and the keys, as they are or moved by a
per-token key shift. RoPE's rotations add (Su et al. 2021, Eq. 34: ``(i + s_q) - (j + s_k) = (i + s_q - s_k) - j``),
so a constant key shift is the query moved back instead (:func:`query_views`): a decoding step then turns one
query row, not the whole cache.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .parts import Part, Shift
from .rotary import rotation
from .shifts import shift_angles


@dataclass(frozen=True, eq=False)
class Cell:
    """The pairs ``lo <= i - j < hi`` of ``part`` (``hi``: the part's bound cut by the model's sliding window,
    ``None``: unbounded), with the part's shifts, key span and rotary pairs."""

    part: Part
    lo: int
    hi: int | None

    @property
    def query_shift(self) -> Shift:
        return self.part.query_shift

    @property
    def key_shift(self) -> Shift:
        return self.part.key_shift

    @property
    def key_constant(self) -> float:
        """The key shift where it is a constant, else 0 (a per-token key shift moves the keys themselves)."""
        return 0.0 if callable(self.part.key_shift) else float(self.part.key_shift)

    @property
    def by_distance_alone(self) -> bool:
        """Whether the cell's pairs are its distance bounds alone: no key span (DCA), no per-head pairs (DPE)."""
        return self.part.key_span is None and self.part.pairs is None

    def span(self, q_positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The key positions ``[first, stop)`` ``[B, Lq]`` each query may attend here (DCA's chunks), or ``None``."""
        return None if self.part.key_span is None else self.part.key_span(q_positions)


def upper_bound(part: Part, sliding_window: int | None) -> int | None:
    """The part's exclusive distance bound under the model's sliding window (``None``: unbounded)."""
    if sliding_window is None:
        return part.max_distance
    return sliding_window if part.max_distance is None else min(part.max_distance, sliding_window)


def lower(parts: Sequence[Part], sliding_window: int | None) -> tuple[Cell, ...]:
    """Every part that holds a pair under the model's sliding window, as a cell."""
    cells = []
    for part in parts:
        hi = upper_bound(part, sliding_window)
        if hi is None or hi > part.min_distance:
            cells.append(Cell(part, part.min_distance, hi))
    return tuple(cells)


def query_views(cells: Sequence[Cell]) -> tuple[list[tuple[Shift, float]], list[int]]:
    """The moved queries the cells read, once each: ``(views, index)``. A view is ``(query shift, constant key
    shift)``, the query moved by the difference; ``index[c]`` is cell ``c``'s view, 0 the query as it is (a cell
    whose constant shifts are equal), ``v >= 1`` ``views[v - 1]``."""
    views, index = [], []
    for cell in cells:
        view = (cell.query_shift, cell.key_constant)
        if not callable(cell.query_shift) and cell.query_shift == cell.key_constant:
            index.append(0)
            continue
        if view not in views:
            views.append(view)
        index.append(1 + views.index(view))
    return views, index


def key_views(cells: Sequence[Cell]) -> tuple[list[Callable], list[int]]:
    """The per-token key shifts the cells read, once each: ``(shifts, index)``; ``index[c]`` is 0 for the keys as
    they are (a constant key shift, folded into the query by :func:`query_views`), ``v >= 1`` for ``shifts[v - 1]``."""
    shifts, index = [], []
    for cell in cells:
        if not callable(cell.key_shift):
            index.append(0)
            continue
        if cell.key_shift not in shifts:
            shifts.append(cell.key_shift)
        index.append(1 + shifts.index(cell.key_shift))
    return shifts, index


def view_angles(
    views: Sequence[tuple[Shift, float]], q_positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` ``[V, B, 1, Lq, P]`` of each query view's move: its query shift less its constant key shift."""
    batch, q_len = q_positions.shape
    angles = []
    for shift, key_constant in views:
        if callable(shift):
            angles.append(
                shift_angles(lambda p, shift=shift, by=key_constant: shift(p) - by, q_positions, inv_freq, dtype)
            )
        else:
            angles.append(rotation(shift - key_constant, inv_freq, dtype, q_positions.device))
    shape = (batch, 1, q_len, inv_freq.shape[-1])
    cos, sin = [torch.stack([angle[side].expand(shape) for angle in angles]) for side in (0, 1)]
    return cos, sin

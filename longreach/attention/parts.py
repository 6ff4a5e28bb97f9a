"""The kernel's contract: what a position method hands the attention kernel.

A method is a set of disjoint :class:`Part` s of the causal triangle (``lo <= i - j < hi``), each with
a position shift for its queries and keys; RoPE's rotations add, so an already-rotated query moved by
``delta`` sits at ``i + delta``. The kernel (:mod:`.kernel`) defines this contract and the methods
(:mod:`longreach.methods`) produce it, as FlexAttention's ``mask_mod`` signature is defined beside its kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

Shift = float | Callable[[torch.Tensor], torch.Tensor]
"""A position shift: a constant, or a function of the tokens' absolute positions ``[B, L]`` (Self-Extend,
DCA) returning ``[B, L]``, or ``[B, L, G]`` for a shift per frequency: one value per group of ``P / G``
consecutive rotary pairs, highest frequency first (DPE)."""


@dataclass(frozen=True, eq=False)
class Part:
    """Pairs with ``min_distance <= i - j < max_distance`` (``None``: no upper bound).

    RoPE sees the query at ``i + query_shift`` and the key at ``j + key_shift`` inside the part, so
    the relative position there is ``i - j + query_shift - key_shift``; a shift may be a function of
    the absolute positions. ``key_span``, for regions not given by distance alone (DCA's chunks),
    maps query positions ``[B, Lq]`` to the ``[first, stop)`` key positions they may attend here.
    ``key_shift_block = b`` declares that the key shift is constant on every aligned block
    ``[m b, (m + 1) b)`` of key positions (DCA's chunks): a decoding step then moves the query by
    each block's shift instead of moving every cached key. ``pairs``, a boolean ``[query heads,
    rotary pairs]`` tensor, limits the shifts to the pairs it marks in each head; the other pairs keep
    their original positions there (DPE's selected dimensions).
    """

    min_distance: int = 0
    max_distance: int | None = None
    query_shift: Shift = 0.0
    key_shift: Shift = 0.0
    key_span: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None
    key_shift_block: int | None = None
    pairs: torch.Tensor | None = None


NEG_INF = float("-inf")
"""The score of a pair no part covers (and a row's log-sum-exp when it attends no key)."""


def covers(distance, lo, hi=None, real=None, key_position=None, span=None):
    """Which pairs a part covers: ``lo <= i - j < hi`` (``hi=None``: unbounded), a real key (``real``: False at
    padding), and, for a part with a key span (DCA's chunks), a key position in ``[first, stop)`` (``span``). Every
    argument is a tensor or number broadcastable against ``distance = i - j``; every backend and the decoding step
    under ``torch.compile`` decide a pair with this one rule."""
    inside = distance >= lo
    if hi is not None:
        inside = inside & (distance < hi)
    if real is not None:
        inside = inside & real
    if span is not None:
        first, stop = span
        inside = inside & (key_position >= first) & (key_position < stop)
    return inside

"""The forward passes in progress, each with what every one of its layers shares (see :class:`Passes`)."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from ..attention.memo import Memo
from .positions import Keys


class Passes:
    """The forward passes in progress: for each attention mask a :class:`~longreach.attention.memo.Memo` and
    the :class:`Keys`, so that every layer of a pass shares what depends on positions alone (plans, block
    masks, shift angles, the host syncs that find padding) instead of building it again.

    A pass is known by the objects transformers hands every layer -- the attention mask (one per layer
    type) and ``position_ids`` -- held by weak reference, so a freed tensor never matches a new one, and by
    the shapes of the call. The few most recent are kept. Copies start empty (a copied model makes its own).
    """

    KEPT = 4

    def __init__(self) -> None:
        self.parts: dict[int | str | None, tuple] = {}  # a layer's parts (None: every layer's; "no rope": plain)
        self.layers: dict[int | None, Any] = {}  # each attention layer's share of what is applied (AppliedLayer)
        self.recent: list[tuple] = []  # (mask ref, position_ids ref, shapes, memo, keys), the newest last

    def __deepcopy__(self, memo_of_copy) -> Passes:
        return Passes()

    def find(self, mask, position_ids, shapes: tuple, build_keys: Callable[[], Keys]) -> tuple[Memo, Keys]:
        """The memo and keys of the pass that ``mask`` and ``position_ids`` (tensors or ``None``) belong to."""
        for entry in self.recent:
            mask_ref, position_ref, known_shapes, memo, keys = entry
            if known_shapes == shapes and _same(mask_ref, mask) and _same(position_ref, position_ids):
                return memo, keys
        memo, keys = Memo(), build_keys()
        self.recent = [*self.recent[-(self.KEPT - 1) :], (_ref(mask), _ref(position_ids), shapes, memo, keys)]
        return memo, keys


def _ref(tensor: torch.Tensor | None):
    return None if tensor is None else weakref.ref(tensor)


def _same(ref, tensor: torch.Tensor | None) -> bool:
    return tensor is None if ref is None else ref() is tensor

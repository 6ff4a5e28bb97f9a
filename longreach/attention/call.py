"""One call of the attention kernel: what every backend needs, in one record instead of fifteen arguments."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .memo import Memo
from .parts import Part
from .shifts import MovedKeys


@dataclass(frozen=True, eq=False)
class Call:
    """The arguments of :func:`.kernel.attention` once the defaults are resolved (:func:`.shifts.prepare`): the scale
    is a number, the positions are given, and the logit scale is already on the query's rotary dimensions.

    Queries are the last ``Lq`` of the ``Lkv`` keys: query row ``t`` sits at key index ``t + offset``.
    """

    query: torch.Tensor  # [B, Hq, Lq, D], rotated
    key: torch.Tensor  # [B, Hkv, Lkv, D], rotated
    value: torch.Tensor  # [B, Hkv, Lkv, Dv]
    parts: tuple[Part, ...]
    inv_freq: torch.Tensor  # [P]: the rotary pairs' frequencies
    scaling: float
    positions: torch.Tensor  # [B, Lkv]: the keys' absolute positions
    memo: Memo
    key_padding: torch.Tensor | None = None  # [B, Lkv], False at padding keys
    sliding_window: int | None = None
    tile: int = 512
    kept_keys: MovedKeys | None = None
    augment: bool = False  # DPE in decoding: moved and plain keys side by side (:func:`.shifts.augmented`)

    @property
    def batch(self) -> int:
        return self.query.shape[0]

    @property
    def q_len(self) -> int:
        return self.query.shape[2]

    @property
    def kv_len(self) -> int:
        return self.key.shape[2]

    @property
    def offset(self) -> int:
        """The key index of query row 0."""
        return self.kv_len - self.q_len

    @property
    def q_positions(self) -> torch.Tensor:
        """``[B, Lq]``: the queries' positions."""
        return self.positions[:, self.offset :]

    @functools.cached_property
    def needs_grad(self) -> bool:
        """Whether autograd will differentiate the call."""
        return torch.is_grad_enabled() and any(t.requires_grad for t in (self.query, self.key, self.value))

    @property
    def fusable(self) -> bool:
        """Whether a backend that takes every part in one forward pass can compute the call: no gradients, no
        per-head rotary pairs (DPE)."""
        return not self.needs_grad and all(part.pairs is None for part in self.parts)

    @property
    def geometry(self) -> tuple:
        """What, beside the positions, padding and parts, decides the layout of a call: for :class:`.memo.Memo` keys."""
        return self.batch, self.q_len, self.kv_len, self.query.dtype, str(self.query.device), self.tile, self.needs_grad

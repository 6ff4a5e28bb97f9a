"""The tiled kernel: backends that compute one block of keys per call (:mod:`..plan`), merged by log-sum-exp.

Each cell is plain softmax attention over its region with q and k moved by the part's shifts
(:mod:`..shifts`); the blocks that cover a cell's region are its plan, each one call of the backend's
:meth:`TiledBackend.block`, and the cells' results are merged by their log-sum-exp (:mod:`..merge`). A backend
without a backward of its own runs on tiles and is differentiated by :mod:`..autograd`. DPE's per-head pairs, in
decoding, put the moved and the plain keys side by side (:func:`..shifts.augmented`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch

from .. import block_math
from ..autograd import PartsAttention
from ..call import Call
from ..cells import Cell
from ..memo import MAX_HELD_MASK_ELEMENTS
from ..merge import run
from ..plan import SMALL_QUERY, Block, blocks, padded_keys
from ..shifts import augmented, shifted
from ..views import angles, moved_keys
from .base import Backend, nothing_attended


class TiledBackend(Backend):
    """A backend that computes one :class:`..plan.Block` per call (:meth:`block`), with an exact :meth:`backward`
    where it has one (else the math backward, tile by tile: :mod:`..autograd`)."""

    has_backward: ClassVar[bool] = False  # :meth:`backward` is the block's exact backward
    differentiates_itself: ClassVar[bool] = False  # autograd goes through ``block`` (FlexAttention)
    takes_wide_queries: ClassVar[bool] = False  # queries wider than values (DPE's side-by-side keys)

    def block(self, q, k, v, mask, causal: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
        """One block: ``q [B, Hq, T, D]`` against ``k``, ``v [B, Hkv, K, D]`` with an additive ``mask`` and/or a
        top-left ``causal`` one; ``(out [B, Hq, T, Dv], lse [B, Hq, T])``."""
        raise NotImplementedError

    def backward(self, grad_out, q, k, v, out, lse, mask, causal: bool, scaling: float):
        """``(dq, dk, dv)`` of one block, given the merged output and log-sum-exp (where :attr:`has_backward`)."""
        raise NotImplementedError

    def block_for(self, q: torch.Tensor, value: torch.Tensor) -> Callable:
        """The block function for a cell: this backend's, or the math backend's where query and key are wider
        than the value (DPE's side-by-side keys), which the flash kernels refuse."""
        return self.block if q.shape[-1] == value.shape[-1] or self.takes_wide_queries else block_math.block

    def whole_blocks(self, call: Call) -> bool:
        """Whether unmasked blocks may be as large as the region allows (else tiles, differentiated tile by tile)."""
        return not call.needs_grad or self.has_backward

    def prepare(self, cells: tuple[Cell, ...], call: Call) -> list[list[Block]] | None:
        """Each cell's blocks (:mod:`..plan`); never ``None`` here, a subclass may decline (:mod:`.cuda_cudnn`)."""
        padded = padded_keys(call.key_padding, call.q_len, call.kv_len)
        return [self.plan(cell, call, padded) for cell in cells]

    def plan(self, cell: Cell, call: Call, padded: int) -> list[Block]:
        """The blocks that cover the cell's pairs: masked tiles, or with whole blocks the structured plan."""
        structured = self.whole_blocks(call) and cell.part.key_span is None and call.q_len > SMALL_QUERY
        span = None if cell.part.key_span is None else (cell.part.key_span, call.positions)
        return list(
            blocks(
                call.q_len,
                call.kv_len,
                cell.lo,
                cell.hi,
                call.offset,
                call.key_padding,
                padded,
                span,
                self.tile(call),
                structured,
                call.query.dtype,
                call.query.device,
            )
        )

    def tile(self, call: Call) -> int:
        """Query rows per tile of the plan (a band's tiles are up to twice as tall: :func:`..plan.blocks`)."""
        return call.tile

    def keep(self, plans: list[list[Block]] | None) -> bool:
        if plans is None:  # declined: held too, so that every layer of the pass hands the call on at once
            return True
        held = sum(b.mask.numel() for plan in plans for b in plan if isinstance(b.mask, torch.Tensor))
        return held <= MAX_HELD_MASK_ELEMENTS

    def run(self, plans: list[list[Block]], cells: tuple[Cell, ...], call: Call) -> tuple[torch.Tensor, torch.Tensor]:
        kept, inputs = [], []
        keys: dict[tuple[int, int], torch.Tensor] = {}  # moved keys by (key shift, pairs)
        for cell, plan in zip(cells, plans, strict=True):
            if not plan:  # no pair of the cell here (a decoding step's other chunks): nothing to move
                continue
            part = cell.part
            if call.augment and part.pairs is not None:
                # [B, Hq, Lq, 2D], [B, Hkv, Lkv, 2D]: moved and plain pairs side by side
                q, k = augmented(call.query, call.key, part, call.q_positions, call.positions, call.inv_freq)
            else:
                # [B, Hq, Lq, D]
                q = shifted(
                    call.query,
                    part.query_shift,
                    call.q_positions,
                    call.inv_freq,
                    part.pairs,
                    angles(call, "query", part.query_shift, call.q_positions),
                )
                moved_id = (id(part.key_shift), id(part.pairs))  # DCA's three parts turn keys once
                if (moved := keys.get(moved_id)) is None:
                    moved = keys[moved_id] = moved_keys(call, part.key_shift, part.pairs)
                k = moved  # [B, Hkv, Lkv, D]
            kept.append(plan)
            inputs += [q, k]
        if not inputs:  # no cell reaches a key
            return nothing_attended(call)
        if call.needs_grad and not self.differentiates_itself:
            return PartsAttention.apply(kept, self, call.scaling, call.value, *inputs)
        return run(kept, self, call.scaling, call.value, inputs)

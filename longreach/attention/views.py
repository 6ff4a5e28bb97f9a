"""The moved queries and keys the cells read, with the angles that depend on positions alone held for the pass."""

from __future__ import annotations

import torch

from .call import Call
from .parts import Shift
from .rotary import compute_dtype, rotation
from .shifts import KEY_ROTATIONS, shift_angles, shifted_keys


def angles(call: Call, side: str, shift: Shift, positions: torch.Tensor):
    """``(cos, sin)`` of a shift, once per forward pass (``None`` for no shift): of a constant, or of a per-token
    shift at ``positions``; a key shift's come from :data:`.shifts.KEY_ROTATIONS`, which a decoding step extends."""
    compute = compute_dtype(call.query.dtype)
    memo, inv_freq = call.memo, call.inv_freq
    if not callable(shift):
        return (
            memo.get(
                "constant angles",
                (inv_freq,),
                (shift, compute, str(positions.device)),
                lambda: rotation(shift, inv_freq, compute, positions.device),
            )
            if shift
            else None
        )
    if side == "key":
        return memo.get(
            "key angles",
            (shift, inv_freq),
            call.geometry,
            lambda: KEY_ROTATIONS.get(shift, positions, inv_freq, compute),
        )
    return memo.get(
        "query angles", (shift, inv_freq), call.geometry, lambda: shift_angles(shift, positions, inv_freq, compute)
    )


def moved_keys(call: Call, shift: Shift, pairs: torch.Tensor | None = None) -> torch.Tensor:
    """The keys moved by a key shift ``[B, Hkv, Lkv, D]``: kept across decoding steps by the call's
    :class:`.shifts.MovedKeys` for a per-token shift of every pair (never under autograd), else rotated with the
    forward pass's angles (:func:`angles`)."""
    if call.kept_keys is not None and not call.needs_grad and callable(shift) and pairs is None:
        return call.kept_keys.get(shift, call.key, call.positions, call.inv_freq)
    return shifted_keys(
        call.key, shift, call.positions, call.inv_freq, pairs, angles(call, "key", shift, call.positions)
    )

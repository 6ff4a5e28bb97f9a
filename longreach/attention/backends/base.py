"""What a backend is: :class:`Backend`, the interface every module of :mod:`longreach.attention.backends` implements."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from ..call import Call
from ..cells import Cell
from ..parts import NEG_INF
from ..rotary import compute_dtype


class Backend:
    """One way to compute a call's cells. Subclasses set the class attributes and override what differs."""

    name: ClassVar[str]
    summary: ClassVar[str]  # one line for the docs and ``apply``'s docstring
    model_devices: ClassVar[tuple[str, ...] | None] = None  # where ``apply`` accepts a model (None: anywhere)
    fallback: ClassVar[str | None] = None  # who computes the calls ``prepare`` declines (None: the next that wants it)
    folds_block_key_shifts: ClassVar[bool] = True  # decoding: DCA's per-chunk key shifts become per-chunk queries

    def unavailable(self, query: torch.Tensor) -> str | None:
        """Why the backend cannot run on ``query``'s device and dtype, or ``None``."""
        return None

    def refuses(self, query: torch.Tensor, fusable: bool, needs_grad: bool) -> str | None:
        """Why the backend cannot compute a call with these properties (``fusable``: see :attr:`.call.Call.fusable`),
        or ``None``; asked for by name, the call then fails with that reason."""
        return None

    def wants(self, query: torch.Tensor, fusable: bool) -> bool:
        """Whether ``auto`` should take this backend for the call (asked in :data:`REGISTRY`'s order)."""
        return False

    def prepare(self, cells: tuple[Cell, ...], call: Call) -> object | None:
        """What the call's positions, padding and cells alone decide (held for the forward pass), or ``None`` to hand
        the call to :attr:`fallback`."""
        return cells

    # ``prepared`` (keep, run) is what this backend's own prepare returned, of a type each backend chooses: Any here,
    # so that a backend's methods name their own
    def keep(self, prepared: Any) -> bool:
        """Whether ``prepared`` is small enough to hold for a forward pass."""
        return True

    def run(self, prepared: Any, cells: tuple[Cell, ...], call: Call) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out [B, Hq, Lq, Dv], lse [B, Hq, Lq])``, ``out`` in the accumulation dtype or already in the query's (a
        view of ``[B, Lq, Hq, Dv]`` that the kernel returns as it is); a row with no key is 0, ``-inf``."""
        raise NotImplementedError

    def compile_failed(self, error: BaseException) -> bool:
        """Whether ``error`` is this backend failing to compile (``auto`` then gives it up: :meth:`give_up`)."""
        return False

    def give_up(self, error: BaseException) -> None:
        """Stop choosing this backend for ``auto`` in this process, with one warning."""

    def model_problem(self, device: str) -> str | None:
        """Why a model on ``device`` cannot use this backend, or ``None``."""
        if self.model_devices is None or device in self.model_devices:
            return None
        where = "on a CUDA device" if "cuda" in self.model_devices else "on the CPU"
        return f"backend={self.name!r} needs a model {where}; this model is on {device!r}"


def nothing_attended(call: Call) -> tuple[torch.Tensor, torch.Tensor]:
    """The result of a call whose cells reach no key: ``out`` 0, ``lse`` ``-inf``, in the accumulation dtype."""
    batch, heads, q_len = call.query.shape[:3]
    accumulate = compute_dtype(call.query.dtype)
    return (
        torch.zeros(batch, heads, q_len, call.value.shape[-1], dtype=accumulate, device=call.query.device),
        torch.full((batch, heads, q_len), NEG_INF, dtype=accumulate, device=call.query.device),
    )

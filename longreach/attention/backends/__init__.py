"""The backends: who computes a call's cells, behind one registry.

Each backend is one module here, named after it, holding one :class:`Backend`; a backend with several files is a
sub-package of that name, its ``__init__`` the backend and its kernels beside it (:mod:`.triton`: ``kernel`` and
``launch``; :mod:`.cuda_cudnn`: ``kernels``; :mod:`.flex`: ``masks``). :mod:`.tiled` holds what the tiled ones share
(:class:`.tiled.TiledBackend`). A backend declares where it runs and which calls it takes, and says why when a call
does not fit (as vLLM's attention backends do with ``validate_configuration``); ``prepare(cells, call)`` lays out
what depends on the positions alone, once per forward pass, and ``run`` computes ``(out, lse)``. :func:`pick` resolves
a name (``auto``: the first backend of :data:`REGISTRY` that wants the call), and :func:`model_problem` checks a
model's device for ``apply``. Adding a backend is one module (or sub-package) and one line in :data:`REGISTRY`
(docs/how-it-works.md walks through it).
"""

from __future__ import annotations

import torch

from . import cpu_flash, cpu_fused, cuda_cudnn, cuda_efficient, cuda_flash, flex, math, triton
from .base import Backend

REGISTRY: dict[str, Backend] = {
    backend.name: backend
    for backend in (
        cpu_fused.BACKEND,
        cpu_flash.BACKEND,
        triton.BACKEND,
        cuda_cudnn.BACKEND,
        flex.BACKEND,
        cuda_efficient.BACKEND,
        cuda_flash.BACKEND,
        math.BACKEND,
    )
}
"""Every backend by name, in ``auto``'s order of preference (``math``, which takes anything, last)."""


def names() -> list[str]:
    """What ``backend=`` takes: ``auto``, then every backend of :data:`REGISTRY`."""
    return ["auto", *REGISTRY]


def pick(query: torch.Tensor, name: str, fusable: bool = False, needs_grad: bool = False) -> Backend:
    """The backend ``name`` for a call on ``query``, after checking it can compute the call; ``auto``: the first backend
    of :data:`REGISTRY` that wants it (float64 always takes ``math``, the precise one)."""
    if name == "auto":
        if query.dtype == torch.float64:
            return REGISTRY["math"]
        return next(backend for backend in REGISTRY.values() if backend.wants(query, fusable))
    if name not in REGISTRY:
        raise ValueError(f"backend={name!r} is not one of: {', '.join(names())}")
    backend = REGISTRY[name]
    reason = backend.unavailable(query) or backend.refuses(query, fusable, needs_grad)
    if reason:
        raise ValueError(reason)
    return backend


def model_problem(backend: str, device: str) -> str | None:
    """Why ``apply`` cannot give a model on ``device`` the backend ``backend`` (or ``reference``), or ``None``."""
    if backend in ("auto", "reference"):
        return None
    if backend not in REGISTRY:
        return f"backend={backend!r} is not one of: auto, reference, {', '.join(REGISTRY)}"
    return REGISTRY[backend].model_problem(device)

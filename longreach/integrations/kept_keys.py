"""Show each layer's kept moved keys (``apply(..., keep_moved_keys=True)``) the cache they were moved from.

The attention function never sees transformers' cache object, only the key tensor it returns. A forward
pre-hook on every attention module -- PyTorch's public ``register_forward_pre_hook`` -- sees the cache among the
module's keyword arguments before the module writes its new keys, and hands the layer's key tensor there to
:meth:`~longreach.attention.shifts.MovedKeys.vouch`. Without a cache, or with a cache whose layer does not hold
the tensor the layer last received, nothing kept is used.
"""

from __future__ import annotations

import torch
from torch import nn

HOOK = "_longreach_kept_keys_hook"  # the hook's handle, in the module's __dict__ (a deep copy gets its own)
CACHE_ARGUMENTS = ("cache", "past_key_values")  # transformers >= 5.24 names it ``cache``; before, ``past_key_values``


def watch(model: nn.Module) -> None:
    """Hook every module of ``model`` that calls the attention function (those with a ``layer_idx``)."""
    for module in model.modules():
        if hasattr(module, "layer_idx") and HOOK not in module.__dict__:
            module.__dict__[HOOK] = module.register_forward_pre_hook(_vouch, with_kwargs=True)


def unwatch(model: nn.Module) -> None:
    """Remove what :func:`watch` added."""
    for module in model.modules():
        handle = module.__dict__.pop(HOOK, None)
        if handle is not None:
            handle.remove()


def cached_keys(cache, layer: int | None) -> torch.Tensor | None:
    """The key tensor ``cache`` holds for attention layer ``layer``, or ``None`` where it has none to show."""
    layers = getattr(cache, "layers", None)
    if layer is None or not isinstance(layers, (list, tuple)) or not 0 <= layer < len(layers):
        return None
    keys = getattr(layers[layer], "keys", None)
    return keys if isinstance(keys, torch.Tensor) else None


def _vouch(module: nn.Module, args: tuple, kwargs: dict) -> None:
    state = module.__dict__.get("_longreach")
    if state is None or not state.keep_moved_keys or torch.compiler.is_compiling():
        return
    cache = next((kwargs[name] for name in CACHE_ARGUMENTS if kwargs.get(name) is not None), None)
    layer = getattr(module, "layer_idx", None)
    state.kept_keys_of(layer).vouch(cached_keys(cache, layer))

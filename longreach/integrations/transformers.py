"""Plug a position method into a stock transformers model through its public extension points.

``apply`` registers one attention function with ``AttentionInterface`` and one mask function
with ``AttentionMaskInterface`` under a fresh name, and switches the model to it with
``set_attn_implementation``; no transformers class is patched. The mask function hands the
attention function a key-padding mask ``[B, 1, 1, Lkv]`` (or ``None``) instead of the dense
``[B, 1, Lq, Lkv]`` causal mask, so nothing n x n is built: causality and the method's regions
come from the kernel. Without the mask registration transformers would pass ``None`` and padded
batches would silently go wrong.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import itertools
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from .. import methods
from ..attention import kernel, reference
from ..attention.rotary import find_rotary, inverse_frequencies
from ..methods import drop as drops
from ..methods.base import PositionMethod
from ..methods.scaling import ALIASES as FREQUENCY_METHODS
from ..methods.scaling import Scaling

SUPPORTED_FAMILIES = "Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma 3, Phi-3, SmolLM and other decoder-only RoPE models"
_names = itertools.count()


@dataclass
class Applied:
    method: PositionMethod
    name: str
    previous: str
    window: int
    scaling: Scaling | None = None
    restore_rotary: Callable[[], None] | None = None
    drop: drops.Drop | drops.DynamicDrop | None = None

    def describe(self) -> str:
        extras = [x.describe() for x in (self.scaling, self.drop) if x is not None]
        return " + ".join([self.method.describe(), *extras])


_applied: "weakref.WeakKeyDictionary[nn.Module, Applied]" = weakref.WeakKeyDictionary()
_probe: contextvars.ContextVar = contextvars.ContextVar("longreach_probe", default=None)


@contextlib.contextmanager
def probing(rows: torch.Tensor, top_k: int):
    """Record, per layer, the mean (over heads) of the ``top_k`` largest attention probabilities of the
    queries at absolute indices ``rows`` during prefill, with whatever method is applied.

    Yields a dict ``{layer index: [batch, len(rows)] tensor}`` filled by the forward pass.
    """
    record: dict[int, torch.Tensor] = {}
    token = _probe.set((rows, top_k, record))
    try:
        yield record
    finally:
        _probe.reset(token)


def training_window(config) -> int:
    """``L``: ``original_max_position_embeddings`` where the config has one, else ``max_position_embeddings``."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    rope = getattr(config, "rope_parameters", None) or {}
    for source in (rope, rope.get("full_attention") or {}):
        if isinstance(source, dict) and source.get("original_max_position_embeddings"):
            return int(source["original_max_position_embeddings"])
    if getattr(config, "original_max_position_embeddings", None):
        return int(config.original_max_position_embeddings)
    return int(config.max_position_embeddings)


def apply(model: nn.Module, method: str = "string", *, scaling: dict | None = None, drop: dict | None = None,
          backend: str = "auto", **params) -> nn.Module:
    """Switch ``model``'s attention to ``method`` (see ``longreach.methods.available()``); returns the model.

    ``method`` is a position method (``rope``, ``string``, ``rerope``, ``self_extend``, ``dca``) or a
    frequency method (``pi``, ``ntk``, ``dynamic``, ``yarn``, ``llama3``), each with its parameters.
    ``scaling={"rope_type": "yarn", "factor": 2.0, ...}`` adds a frequency method to a position
    method (transformers' ``rope_parameters`` keys; ``pi`` and ``ntk`` are accepted as types).
    ``method="drop"`` / ``"dynamic_drop"`` (Drop Attention, Dynamic Drop Attention) with their
    parameters, or ``drop={"method": "dynamic_drop", ...}`` beside another method, drops low scores.
    ``backend``: ``"auto"`` (CPU flash attention on CPU, memory-efficient attention on CUDA),
    ``"cpu_flash"``, ``"cuda_efficient"``, ``"math"``, or ``"reference"`` (the dense float64 oracle,
    O(n^2), for tests). Applying again replaces the previous method; :func:`remove` undoes it.
    """
    if find_rotary(model) is None:
        raise ValueError(
            f"{model.__class__.__name__} has no rotary position embedding (no module with an inv_freq buffer); "
            f"longreach's methods work on RoPE models: {SUPPORTED_FAMILIES}"
        )
    valid_backends = ("auto", "reference", *kernel.BACKENDS)
    if backend not in valid_backends:
        raise ValueError(f"backend={backend!r} is not one of: {', '.join(valid_backends)}")
    window = _applied[model].window if model in _applied else training_window(model.config)  # before any rescaling
    position_method, frequency, dropping = _resolve(model, window, method, scaling, drop, params)
    if model in _applied:
        remove(model)
    restore_rotary = _rescale(model, frequency) if frequency else None
    name = f"longreach_{position_method.name}_{next(_names)}"
    forward = _reference_forward if backend == "reference" else _kernel_forward
    AttentionInterface.register(name, _bind(forward, position_method, dropping, window, weakref.ref(find_rotary(model)), backend))
    AttentionMaskInterface.register(name, key_padding_mask)
    _applied[model] = Applied(position_method, name, model.config._attn_implementation, window, frequency, restore_rotary, dropping)
    model.set_attn_implementation(name)
    return model


def _resolve(model, window, method, scaling, drop, params):
    """Validate everything before touching the model: ``(position method, frequency method, drop method)``."""
    if method in FREQUENCY_METHODS:
        if scaling is not None:
            raise ValueError(f"{method} is a frequency method already; give scaling= with a position method instead")
        method, scaling, params = "rope", {"rope_type": method, **params}, {}
    elif method in drops.DROPS:
        if drop is not None:
            raise ValueError(f"{method} is a drop method already; give drop= with a position method instead")
        method, drop, params = "rope", {"method": method, **params}, {}
    position_method = methods.create(method, training_window=window, **params)
    frequency = dropping = None
    if scaling is not None:
        scaling = dict(scaling)
        frequency = Scaling.create(scaling.pop("rope_type", None) or scaling.pop("method", "missing"), window, **scaling)
    if drop is not None:
        drop = dict(drop)
        dropping = drops.create(drop.pop("method", "drop"), **drop)
        layers = model.config.get_text_config().num_hidden_layers
        if max(dropping.layers) >= layers:
            raise ValueError(f"layers={list(dropping.layers)} is out of range: layer indices 0 .. {layers - 1}")
    return position_method, frequency, dropping


def remove(model: nn.Module) -> nn.Module:
    """Restore the attention (and RoPE frequencies) the model had before :func:`apply`; a no-op on an untouched model."""
    state = _applied.pop(model, None)
    if state is not None:
        model.set_attn_implementation(state.previous)
        AttentionInterface._global_mapping.pop(state.name, None)
        AttentionMaskInterface._global_mapping.pop(state.name, None)
        if state.restore_rotary:
            state.restore_rotary()
    return model


def describe(model: nn.Module) -> str:
    """What is applied to ``model``: ``"rope"`` for an untouched model."""
    state = _applied.get(model)
    return state.describe() if state else "rope"


def _rescale(model: nn.Module, frequency: Scaling) -> Callable[[], None]:
    """Rebuild the rotary embedding with transformers' initialiser for the new ``rope_parameters``.

    A new module of the model's own rotary class replaces the old one (kept for restoring);
    the model config's ``rope_parameters`` are updated too, so that saving the model records them.
    """
    config = model.config.get_text_config()
    current = config.rope_parameters
    if not isinstance(current, dict) or "rope_theta" not in current:
        raise ValueError(
            f"frequency methods need one set of rope_parameters; {model.__class__.__name__} has one per layer type "
            f"({', '.join(current)}): apply a position method without scaling"
        )
    rotary = find_rotary(model)
    parent_name, _, attribute = next(n for n, m in model.named_modules() if m is rotary).rpartition(".")
    parent = model.get_submodule(parent_name)
    new_config = copy.deepcopy(config)
    new_config.rope_parameters = frequency.rope_parameters(current, 2 * rotary.inv_freq.shape[-1])
    replacement = type(rotary)(new_config).to(rotary.inv_freq.device)
    setattr(parent, attribute, replacement)
    config.rope_parameters = copy.deepcopy(new_config.rope_parameters)

    def restore() -> None:
        setattr(parent, attribute, rotary)
        config.rope_parameters = current

    return restore


def applied(model: nn.Module) -> PositionMethod | None:
    """The position method currently applied to ``model``, if any."""
    state = _applied.get(model)
    return state.method if state else None


def key_padding_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, attention_mask=None, **_) -> torch.Tensor | None:
    """``AttentionMaskInterface`` function: only which keys are real, ``[B, 1, 1, Lkv]``, or ``None``."""
    if attention_mask is None:
        return None
    if (missing := kv_offset + kv_length - attention_mask.shape[-1]) > 0:  # as transformers pads it
        attention_mask = torch.nn.functional.pad(attention_mask, (0, missing), value=True)
    padding = attention_mask[:, kv_offset : kv_offset + kv_length].bool()
    return None if bool(padding.all()) else padding[:, None, None, :]


def _bind(forward: Callable, method: PositionMethod, dropping, window: int, rotary_ref, backend: str) -> Callable:
    def attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        if dropout:
            raise ValueError(f"longreach attention does not support dropout (got dropout={dropout}); call model.eval()")
        if kwargs.get("softcap") is not None:
            raise NotImplementedError("longreach attention does not support attention logit softcapping (Gemma 2)")
        rotary = rotary_ref()
        inv_freq = inverse_frequencies(rotary, getattr(module, "layer_type", None))
        padding = _key_padding(attention_mask, key.shape[2])
        positions = _key_positions(kwargs, query.shape[0], key.shape[2], query.device)
        rates = None
        if dropping is not None and getattr(module, "layer_idx", None) in dropping.layers:
            generated = query.shape[2] == 1 and key.shape[2] > 1  # a one-token step against the cache
            rates = dropping.rates(positions[:, -query.shape[2] :], window, generated)
        out = forward(method, rotary, module, query, key, value, inv_freq, scaling, padding, positions, rates, backend, kwargs)
        if (probe := _probe.get()) is not None and query.shape[2] == key.shape[2]:
            _record(probe, method, module, query, key, inv_freq, scaling, padding, positions, rates, kwargs)
        return out, None

    return attention_forward


def _record(probe, method, module, query, key, inv_freq, scaling, padding, positions, rates, kwargs) -> None:
    rows, top_k, record = probe
    rows = rows[rows < query.shape[2]].to(query.device)
    tops = [
        probabilities.topk(min(top_k, probabilities.shape[-1]), dim=-1).values.mean(-1).mean(1)  # [B, T]
        for probabilities, _ in kernel.attention_probabilities(
            query[:, :, rows], key, method.parts(), inv_freq, rows, scaling, padding, kwargs.get("sliding_window"),
            method.logit_scale, positions, None if rates is None else rates[:, rows],
        )
    ]
    record[module.layer_idx] = torch.cat(tops, dim=-1).float().cpu()


def _key_padding(mask: torch.Tensor | None, kv_len: int) -> torch.Tensor | None:
    """The ``[B, Lkv]`` key-padding mask our mask function produced (``None``: no padding)."""
    if mask is None:
        return None
    if mask.dim() != 4 or mask.shape[-2] != 1 or mask.shape[-1] != kv_len or mask.dtype != torch.bool:
        raise ValueError(
            f"longreach attention got a custom attention mask of shape {tuple(mask.shape)} ({mask.dtype}); "
            "it supports causal attention with a 2D padding mask [batch, keys] only"
        )
    return mask[:, 0, 0, :]


def _key_positions(kwargs: dict, batch: int, kv_len: int, device) -> torch.Tensor:
    """Absolute positions of the keys ``[B, Lkv]``: contiguous, ending at the last query's position.

    transformers passes the queries' ``position_ids`` (padding-aware under ``generate``); the cache
    holds the keys before them, so key ``j`` sits at ``last - (Lkv - 1 - j)`` (negative for left padding,
    which is masked). Without ``position_ids`` the keys are at ``0 .. Lkv-1``.
    """
    q_pos = kwargs.get("position_ids")
    back = torch.arange(kv_len - 1, -1, -1, device=device)
    if q_pos is None:
        return (kv_len - 1 - back).expand(batch, -1)
    return q_pos.to(device).expand(batch, -1)[:, -1:] - back


def _kernel_forward(method, rotary, module, query, key, value, inv_freq, scaling, padding, positions, rates, backend, kwargs):
    return kernel.attention(
        query, key, value, method.parts(), inv_freq, scaling=scaling, key_padding=padding,
        sliding_window=kwargs.get("sliding_window"), logit_scale=method.logit_scale, positions=positions, drop=rates,
        backend=backend,
    )


def _reference_forward(method, rotary, module, query, key, value, inv_freq, scaling, padding, positions, rates, backend, kwargs):
    """Undo RoPE at the true positions, then the dense per-pair oracle (float64, O(n^2))."""
    if kwargs.get("position_ids") is None:
        raise ValueError("the reference backend needs position_ids in the attention kwargs")
    q_pos = kwargs["position_ids"].expand(query.shape[0], -1).to(query.device)
    k_pos = positions
    layer_type = getattr(module, "layer_type", None)
    attention_scaling = getattr(rotary, f"{layer_type}_attention_scaling", None) or getattr(rotary, "attention_scaling", 1.0)
    q_raw = reference.unrotate(query, q_pos, inv_freq, attention_scaling)
    k_raw = reference.unrotate(key, k_pos, inv_freq, attention_scaling)
    P = method.relative_positions(q_pos[:, :, None], k_pos[:, None, :])
    window = kwargs.get("sliding_window")
    if window is not None:
        P = torch.where(q_pos[:, :, None] - k_pos[:, None, :] < window, P, torch.nan)
    out = reference.dense_attention(
        q_raw, k_raw, value, P, inv_freq, scaling, attention_scaling, padding, method.logit_scale, rates
    )
    return out.to(query.dtype)

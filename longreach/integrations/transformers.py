"""Plug a position method into a stock transformers model through its public extension points.

One attention function and one mask function are registered, once, under the name ``longreach``
(``AttentionInterface`` and ``AttentionMaskInterface``); ``apply`` switches a model to them with
``set_attn_implementation``. No transformers class is patched. What is applied lives with the
model (``model._longreach`` and the same object on every attention module), so a deep copy of an
applied model is applied exactly like its original and each can be removed on its own.

The mask function hands the attention function, instead of a dense ``[B, 1, Lq, Lkv]`` causal mask,
the keys' absolute positions ``[B, 1, 1, Lkv]`` (int64; -1 at padding, left or right, and -2 at the
empty slots of a static cache, which are not keys at all), or ``None`` when every key is real. Nothing n x n is built:
causality and the method's regions come from the kernel. Without the mask registration
transformers would pass ``None`` and padded batches would silently go wrong.

This module applies and removes a method; what it keeps on the model is :mod:`.applied`, each layer's rotary
layout :mod:`.families` (held to the model's own code by :mod:`.self_check`), the attention function
:mod:`.attention`, what a pass records or is told (dispersion, pair importance, prompt lengths) :mod:`.recording`,
the per-pass memo :mod:`.passes`, the key positions :mod:`.positions` and the rotary module a frequency method
swaps in :mod:`.rotary_embedding`.
"""

from __future__ import annotations

import functools
import numbers

from torch import nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface

from .. import methods
from ..attention import backends
from ..methods.base import PositionMethod, require_bool, require_int
from ..methods.dca import qwen_dual_chunk
from ..methods.drop import in_model
from . import families, kept_keys, recording, rotary_embedding
from .applied import Applied
from .attention import attention_forward
from .positions import key_positions_mask
from .rotary_embedding import find_rotary

NAME = "longreach"
CONFIG_KEY = "longreach"  # the applied method, recorded in the model's config (saved by save_pretrained)


def training_window(config) -> int:
    """``L``, the training window every default derives from.

    It is the text config's ``max_position_embeddings``, what the model was trained or tuned for. Not
    ``original_max_position_embeddings``: on Llama 3.1 that is the window before its long-context stage
    (8192); the model was trained to 131072 and the STRING paper uses L = 128K for it. On a model whose config holds
    Qwen2.5-1M's ``dual_chunk_attention_config``, its ``original_max_position_embeddings`` (262144, the length the
    model was trained to; its ``max_position_embeddings``, 1010000, is the length its DCA serves).

    Args:
        config: a transformers model config (a multimodal one's text config is read).

    Returns:
        ``L`` in tokens.
    """
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    own = qwen_dual_chunk(getattr(config, "dual_chunk_attention_config", None) or {})[1]
    return own or int(config.max_position_embeddings)


_model_window = training_window  # apply's keyword argument of the same name hides the function there


def apply(
    model: PreTrainedModel,
    method: str = "string",
    *,
    training_window: int | None = None,
    scaling: dict | None = None,
    drop: dict | None = None,
    backend: str = "auto",
    keep_moved_keys: bool = False,
    **params,
) -> PreTrainedModel:
    """Switch ``model``'s attention to ``method``, in place; every forward and ``generate`` then uses it.

    Everything is validated before the model changes: a refused call leaves the method applied before
    in place. Applying again replaces the previous method; [`remove`][longreach.remove] undoes it.

    Args:
        model: a transformers causal language model with rotary position embeddings (Llama, Qwen,
            Mistral, Gemma 3, Phi-3, SmolLM, ...), on any device, in any dtype.
        method: a position method (``rope``, ``string``, ``rerope``, ``self_extend``, ``dca``, ``dpe``),
            a frequency method (``pi``, ``ntk``, ``dynamic``, ``yarn``, ``llama3``) or a drop method
            (``drop``, ``dynamic_drop``); [`available`][longreach.available] lists them all.
        training_window: ``L``, from which every default derives; default: the text config's
            ``max_position_embeddings`` ([`training_window`][longreach.training_window]).
        scaling: a frequency method composed with a position method, in transformers'
            ``rope_parameters`` keys, e.g. ``{"rope_type": "yarn", "factor": 2.0}`` (``pi`` and ``ntk``
            are accepted as types). ``L`` stays the model's own unless ``training_window`` says otherwise.
        drop: a drop method beside another method, e.g. ``{"method": "dynamic_drop", "max_rate": 0.3}``.
        backend: ``"auto"`` (the first backend of ``longreach.attention.backends.REGISTRY`` that wants the call:
            on a CPU the C++ kernel, built on first use, else CPU flash attention on tiles; on CUDA compiled
            FlexAttention for prefill and the fused Triton kernel for decoding steps), a backend of that registry
            by name (docs/usage.md#backends lists them), or ``"reference"`` (the dense float64 oracle, O(n^2),
            for tests).
        keep_moved_keys: keep, per layer, the cached keys moved by a per-token key shift (ReRoPE's and
            Self-Extend's far part: +50% of the key/value cache), so that a decoding step moves only its
            new keys. They are used only while the cache provably holds what they were moved from (a hook
            before each attention module compares the cache's tensor with the one the layer last saw):
            another conversation, a crop, a beam reorder or a reset moves every key again.
        **params: the method's own parameters, e.g. ``shift=2048, local_window=64`` for ``string``.

    Returns:
        The same ``model``.

    Raises:
        ValueError: one line naming the parameter, its value and what is allowed: an unknown method or
            parameter, a value out of range, a model without RoPE or with logit softcapping, a backend
            its device cannot run.

    Example:
        ```python
        longreach.apply(model, "string")                     # S = round(L/3), W = min(128, L // 16)
        longreach.apply(model, "dca", scaling={"rope_type": "yarn", "factor": 2.0})
        ```
    """
    layouts = families.read_layouts(model)
    _check_model(model, backend)
    require_bool("keep_moved_keys", keep_moved_keys)
    if training_window is None:
        window = _model_window(model.config)  # a frequency method changes rope_parameters, never this
    else:
        require_int("training_window", _plain_number(training_window), 2, None, "an integer >= 2 (tokens)")
        window = int(training_window)
    own_dual_chunk = getattr(model.config.get_text_config(), "dual_chunk_attention_config", None)
    if method == "dca" and own_dual_chunk:  # Qwen2.5-1M's: its chunk and local sizes and temperature by default
        params = {**qwen_dual_chunk(own_dual_chunk)[0], **params}
    position_method, frequency, dropping = _resolve(model, window, method, scaling, drop, params)
    text = model.config.get_text_config()
    pairs = {layout.dims // 2 for layout in layouts.values() if layout.rotated}
    position_method.check_model(text.num_hidden_layers, text.num_attention_heads, max(pairs, default=0))
    # a frequency method may still refuse here, before any change
    rescaled = rotary_embedding.rescaled(model, frequency, _state(model)) if frequency else None
    remove(model)
    own_rotary = find_rotary(model)  # the model's own again, if a frequency method had replaced it
    assert own_rotary is not None
    applied = Applied(
        position_method,
        model.config._attn_implementation,
        window,
        own_rotary,
        layouts,
        backend,
        frequency,
        dropping,
        keep_moved_keys=keep_moved_keys,
    )
    if rescaled:
        rotary_embedding.install(model, applied, *rescaled)
    _attach(model, applied)
    if keep_moved_keys:
        kept_keys.watch(model)
    previous = model.__dict__.get("generate")  # transformers' custom_generate sets one; remove() above took ours away
    model.__dict__["generate"] = functools.partial(recording.generate, model, previous)
    model.set_attn_implementation(NAME)
    setattr(model.config, CONFIG_KEY, applied.record())
    return model


def _plain_number(value):
    """numpy integers and floats count as Python ``int`` and ``float``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return value
    return int(value) if isinstance(value, numbers.Integral) else float(value)


def _check_model(model: PreTrainedModel, backend: str) -> None:
    problem = backends.model_problem(backend, next(model.parameters()).device.type)
    if problem:
        raise ValueError(problem)
    text = model.config.get_text_config()
    if getattr(text, "attn_logit_softcapping", None) is not None:
        raise ValueError(
            f"{model.__class__.__name__} uses attention logit softcapping (attn_logit_softcapping="
            f"{text.attn_logit_softcapping}, Gemma 2), which longreach's attention does not support"
        )


def _resolve(model, window, method, scaling, drop, params):
    """Validate everything before touching the model: ``(position method, frequency method, drop method)``."""
    if not isinstance(method, str):
        raise ValueError(f"method={method!r} must be a method name; see longreach.available()")
    params = {k: _plain_number(v) for k, v in params.items()}
    kind = methods.kind_of(method)
    if kind == "frequency":
        if scaling is not None:
            raise ValueError(f"{method} is a frequency method already; give scaling= with a position method instead")
        method, scaling, params = "rope", {"rope_type": method, **params}, {}
    elif kind == "drop":
        if drop is not None:
            raise ValueError(f"{method} is a drop method already; give drop= with a position method instead")
        method, drop, params = "rope", {"method": method, **params}, {}
    position_method = methods.create(method, training_window=window, **params)
    frequency = None if scaling is None else _frequency_method(scaling, window)
    dropping = None if drop is None else _drop_method(model, drop, window)
    return position_method, frequency, dropping


def _frequency_method(scaling, window):
    """The frequency method ``scaling=`` names (a dict with ``rope_type`` and its parameters)."""
    if not isinstance(scaling, dict):
        raise ValueError(f"scaling={scaling!r} must be a dict such as {{'rope_type': 'yarn', 'factor': 2.0}}")
    scaling = {k: _plain_number(v) for k, v in scaling.items()}
    rope_type = scaling.pop("rope_type", None) or scaling.pop("method", None)
    if rope_type is None:
        raise ValueError(f"scaling={scaling!r} names no rope_type; give e.g. {{'rope_type': 'yarn', 'factor': 2.0}}")
    methods.find(rope_type, "frequency")
    return methods.create(rope_type, window, **scaling)


def _drop_method(model, drop, window):
    """The drop method ``drop=`` names (a dict with ``method``, ``drop`` when absent, and its parameters), its
    layers checked against the model's."""
    if not isinstance(drop, dict):
        raise ValueError(f"drop={drop!r} must be a dict such as {{'method': 'dynamic_drop'}}")
    drop = {k: _plain_number(v) for k, v in drop.items()}
    name = drop.pop("method", "drop")
    methods.find(name, "drop")
    return methods.create(name, window, **in_model(drop, model.config.get_text_config().num_hidden_layers))


def reapply(model: PreTrainedModel, record: dict) -> PreTrainedModel:
    """Apply what :meth:`Applied.record` describes (the ``longreach`` entry of a saved config), with the
    ``auto`` backend (a ``backend`` kept by older versions was a device choice: it is not restored)."""
    return apply(
        model,
        record["method"],
        training_window=record["training_window"],
        scaling=record.get("scaling"),
        drop=record.get("drop"),
        **record.get("params", {}),
    )


def remove(model: PreTrainedModel) -> PreTrainedModel:
    """Restore the attention and RoPE frequencies ``model`` had before [`apply`][longreach.apply].

    A no-op on a model nothing was applied to.

    Args:
        model: a model, applied or not.

    Returns:
        The same ``model``.
    """
    state = _state(model)
    if state is None:
        return model
    kept_keys.unwatch(model)
    for module in model.modules():
        module.__dict__.pop("_longreach", None)
    wrapper = model.__dict__.get("generate")
    if isinstance(wrapper, functools.partial) and wrapper.func is recording.generate:
        del model.__dict__["generate"]
        if wrapper.args[1] is not None:
            model.__dict__["generate"] = wrapper.args[1]
    model.set_attn_implementation(state.previous)
    rotary_embedding.restore(model, state)
    if hasattr(model.config, CONFIG_KEY):
        delattr(model.config, CONFIG_KEY)
    return model


def describe(model: nn.Module) -> str:
    """What is applied to ``model``, with every resolved parameter and the ``L`` it used.

    Args:
        model: a model, applied or not.

    Returns:
        e.g. ``"string(shift=2731, local_window=128, mscale=False) [L=8192]"``; ``"rope"`` for a model
        nothing was applied to.
    """
    state = _state(model)
    return state.describe() if state else "rope"


def one_case_per_forward(model: nn.Module) -> bool:
    """Whether the applied frequencies follow the longest sequence of each forward (dynamic NTK, as
    transformers computes it): a case then depends on its batch and on how its prompt is chunked, so
    the runner decodes it alone, in one forward."""
    state = _state(model)
    return state is not None and state.scaling is not None and state.scaling.name == "dynamic"


def applied(model: nn.Module) -> PositionMethod | None:
    """The position method applied to ``model``.

    Args:
        model: a model, applied or not.

    Returns:
        The method's dataclass (e.g. a [`String`][longreach.methods.string.String]), or ``None``.
    """
    state = _state(model)
    return state.method if state else None


def _state(model: nn.Module) -> Applied | None:
    return model.__dict__.get("_longreach")


def _attach(model: nn.Module, state: Applied) -> None:
    """The same state on the model and on every module that may call the attention function.

    Stored in ``__dict__`` (not as submodules), so ``state_dict`` is unchanged and ``copy.deepcopy``
    copies it once, pointing at the copy's own rotary module.
    """
    model.__dict__["_longreach"] = state
    for module in model.modules():
        if hasattr(module, "layer_idx"):
            module.__dict__["_longreach"] = state


AttentionInterface.register(NAME, attention_forward)
AttentionMaskInterface.register(NAME, key_positions_mask)

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

This module applies and removes a method; the attention function is :mod:`.attention`, what a pass
records or is told (dispersion, pair importance, prompt lengths) :mod:`.recording`, the per-pass memo
:mod:`.passes`, the key positions :mod:`.positions` and the rotary module a frequency method swaps in
:mod:`.rotary_embedding`.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from dataclasses import dataclass

from torch import nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface

from .. import methods
from ..attention import backends
from ..attention.layout import Layout
from ..attention.rotary import inverse_frequencies
from ..attention.shifts import MovedKeys
from ..methods import drop as drops
from ..methods.base import PositionMethod, require_bool, require_int
from ..methods.dca import qwen_dual_chunk
from ..methods.rope import Rope
from ..methods.scaling import Scaling
from . import families, kept_keys, recording, rotary_embedding, self_check
from .attention import attention_forward
from .passes import Passes
from .positions import key_positions_mask
from .rotary_embedding import find_rotary

NAME = "longreach"
CONFIG_KEY = "longreach"  # the applied method, recorded in the model's config (saved by save_pretrained)
SUPPORTED_FAMILIES = "docs/methods.md#families lists the families verified exact"


@dataclass
class Applied:
    """What ``apply`` did to one model; everything ``remove`` needs to undo it (no closures: deep-copyable)."""

    method: PositionMethod
    previous: str
    window: int
    rotary: nn.Module
    layouts: dict[int, Layout]
    backend: str = "auto"
    scaling: Scaling | None = None
    drop: drops.Drop | drops.DynamicDrop | None = None
    replaced_rotary: nn.Module | None = None  # the model's own rotary module, when a frequency method replaced it
    replaced_rope_parameters: dict | None = None
    keep_moved_keys: bool = False
    passes: Passes = dataclasses.field(default_factory=lambda: Passes(), repr=False, compare=False)
    kept_keys: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)  # layer -> MovedKeys

    def kept_keys_of(self, layer: int | None) -> MovedKeys | None:
        """Layer ``layer``'s moved keys kept across decoding steps, with ``keep_moved_keys`` (else None)."""
        if not self.keep_moved_keys:
            return None
        return self.kept_keys.setdefault(layer, MovedKeys())

    def layer(self, index: int | None) -> AppliedLayer:
        """Attention layer ``index``'s share of what is applied: its layout, and what it runs."""
        layer = self.passes.layers.get(index)
        if layer is None:
            if index not in self.layouts:
                raise ValueError(
                    f"attention layer {index} had no rotary layout when the method was applied; apply it again"
                )
            layer = self.passes.layers.setdefault(index, AppliedLayer(self, index, self.layouts[index]))
        return layer

    def layer_parts(self, layer: int | None) -> tuple:
        """The method's parts of attention layer ``layer``, made once per ``apply`` and shared by every layer unless
        they differ by layer (their identity keys each pass's memo)."""
        held = layer if self.method.parts_differ_by_layer else None
        if held not in self.passes.parts:
            self.passes.parts[held] = self.method.layer_parts(layer)
        return self.passes.parts[held]

    def describe(self) -> str:
        extras = [x.describe() for x in (self.scaling, self.drop) if x is not None]
        return " + ".join([self.method.describe(), *extras]) + f" [L={self.window}]"

    def record(self) -> dict:
        """The JSON-able description saved in the model's config: enough for :func:`longreach.load` to re-apply.

        The method, not the device choice: the backend is chosen again where the model is loaded. Whatever
        the method reads from a file (DPE's selected pairs) is stored in the record itself."""
        scaling = None if self.scaling is None else {"rope_type": self.scaling.name, **self.scaling.params}
        drop = None if self.drop is None else {"method": self.drop.name, **_jsonable(dataclasses.asdict(self.drop))}
        return {
            "method": self.method.name,
            "params": _jsonable(self.method.saved_params()),
            "training_window": self.window,
            "scaling": scaling,
            "drop": drop,
            "replaced_rope_parameters": self.replaced_rope_parameters,
        }


@dataclass
class AppliedLayer:
    """One attention layer of an applied model: its :class:`~longreach.attention.layout.Layout`, and what it runs.
    A layer without RoPE runs causal attention as the model's own does, under every method: nothing positional to
    change, no logit factor, no drop."""

    applied: Applied
    index: int | None
    layout: Layout

    @property
    def method(self) -> PositionMethod:
        return self.applied.method if self.layout.rotated else Rope(self.applied.window)

    def parts(self) -> tuple:
        if self.layout.rotated:
            return self.applied.layer_parts(self.index)
        return self.applied.passes.parts.setdefault("no rope", Rope(self.applied.window).parts())

    def frequencies(self):
        """The layer's ``inv_freq``, read at call time (dynamic NTK changes it during a forward pass)."""
        return inverse_frequencies(self.applied.rotary, self.layout.layer_type)

    def attention_scaling(self) -> float:
        """The factor on cos and sin of the layer's frequencies (YaRN's, LongRoPE's; 1.0 without one)."""
        rotary, layer_type = self.applied.rotary, self.layout.layer_type
        per_type = getattr(rotary, f"{layer_type}_attention_scaling", None) if layer_type else None
        return per_type if per_type else getattr(rotary, "attention_scaling", 1.0)


def _jsonable(values: dict) -> dict:
    """Tuples as lists, for the config's JSON."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}


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
    layouts = read_layouts(model)
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


def read_layouts(model: PreTrainedModel) -> dict[int, Layout]:
    """Each attention layer's rotary layout (:mod:`.families`), held to the model's own code by the self-check
    (:mod:`.self_check`; not on an empty model, which has no values to run): ``ValueError`` in one line for a model
    without RoPE, a family not verified, or a model whose rotation departs from its layout."""
    rotary = find_rotary(model)
    if rotary is None:
        raise ValueError(
            f"{model.__class__.__name__} has no rotary position embedding (no module with an inv_freq buffer); "
            f"longreach's methods work on RoPE models: {SUPPORTED_FAMILIES}"
        )
    layouts = families.read(model, rotary)
    if next(model.parameters()).device.type != "meta":  # the rotary module the forward runs, a frequency method's too
        self_check.check(
            model,
            layouts,
            lambda layout: inverse_frequencies(rotary, layout.layer_type),
            families.model_type(model),
            _unchanging_window(model.config.get_text_config()),
        )
    return layouts


def _unchanging_window(config) -> int:
    """The positions at which no dynamic RoPE changes its frequencies: below ``original_max_position_embeddings``
    where a scaling has one (LongRoPE switches factors above it), else the model's window."""
    window = int(getattr(config, "max_position_embeddings", None) or 4096)
    rope = getattr(config, "rope_parameters", None) or {}
    originals = [p.get("original_max_position_embeddings") for p in [rope, *rope.values()] if isinstance(p, dict)] + [
        getattr(config, "original_max_position_embeddings", None)
    ]
    return min([window, *(int(o) for o in originals if o)])


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
    dropping = methods.create(name, window, **drop)
    layers = model.config.get_text_config().num_hidden_layers
    if max(dropping.layers) >= layers:
        raise ValueError(f"layers={list(dropping.layers)} is out of range: layer indices 0 .. {layers - 1}")
    return dropping


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

"""A model's rotary embedding module: found, rebuilt for a frequency method, swapped in and restored.

A frequency method (:mod:`longreach.methods.scaling`) never edits the model's own rotary module: ``apply``
builds a new one of the same class (:func:`rescaled`), puts it in its place (:func:`install`) and keeps the
model's own in the applied state, which ``remove`` puts back (:func:`restore`).
"""

from __future__ import annotations

import copy
import math
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from ..attention.rotary import inverse_frequencies
from ..methods.scaling import STATIC_TYPES, Scaling, describe_own

if TYPE_CHECKING:
    from transformers import PreTrainedModel

MOVING_TYPES = ("dynamic", "longrope")  # a model's own scalings whose frequencies change with the sequence's length


def find_rotary(model: nn.Module) -> nn.Module | None:
    """The model's rotary embedding module (``model.model.rotary_emb`` on decoder-only models): its language model's,
    where a multimodal model's vision tower has one of its own."""
    for _, module in language_model(model).named_modules():
        if module.__class__.__name__.endswith("RotaryEmbedding") and any(
            name == "inv_freq" or name.endswith("_inv_freq") for name, _ in module.named_buffers()
        ):
            return module
    return None


def language_model(model: nn.Module) -> nn.Module:
    """The part of ``model`` that reads text (transformers' ``get_decoder()``: the text model of a multimodal one), or
    ``model`` itself where it has none to name. Only a model counts: ModernBERT-decoder's ``get_decoder()`` answers
    its ``decoder`` head, a linear layer."""
    get_decoder = getattr(model, "get_decoder", None)
    try:
        decoder = get_decoder() if callable(get_decoder) else model
    except (AttributeError, NotImplementedError, ValueError):
        return model
    return decoder if hasattr(decoder, "config") else model


def rescaled(model: PreTrainedModel, frequency: Scaling, state) -> tuple[nn.Module, dict]:
    """A new rotary module of the model's own class for ``frequency``, and the ``rope_parameters`` to record;
    the model is not touched (``apply`` validates everything first). ``state``: what is applied now, or None.

    On a model with RoPE's default frequencies, transformers' own initialiser builds it from the new
    ``rope_parameters``. A model that scales its frequencies already (``linear``, ``yarn``, ``llama3``)
    keeps its scaling and ``frequency`` composes over it (:meth:`Scaling.over`); its ``rope_parameters``
    stay its own, so plain ``from_pretrained`` cannot express the composition (``longreach.load`` can).

    A model with ``rope_parameters`` per layer type (Gemma 3) is rescaled in the layers that attend over the whole
    window only (:func:`scaled_layer_types`): a sliding layer's distances never pass its window, as Google scales
    Gemma 3's larger models (``linear``, factor 8, on ``full_attention`` alone).
    """
    own_rotary, own = _own_rotary(model, state)
    ropes = layer_ropes(own)
    scaled = scaled_layer_types(ropes, own_rotary)
    if not scaled or any("rope_theta" not in ropes[layer_type] for layer_type in scaled):
        raise ValueError(
            f"frequency methods need a rope_theta in rope_parameters; {model.__class__.__name__} has "
            f"{sorted(own)}: apply a position method without scaling"
        )
    config = copy.deepcopy(model.config.get_text_config())
    original = frequency.params.get("original_max_position_embeddings")
    if original is not None and getattr(config, "original_max_position_embeddings", None) is not None:
        # Phi-3 keeps the window outside rope_parameters, and transformers lets that one win over rope_parameters'
        config.original_max_position_embeddings = original
    for layer_type in scaled:
        own_type = ropes[layer_type].get("rope_type", "default")
        if own_type != "default" and own_type not in STATIC_TYPES:
            why = (
                ", whose frequencies change during the forward pass: longreach composes no frequency method over it"
                if own_type in MOVING_TYPES
                else f": longreach composes frequency methods over {', '.join(STATIC_TYPES)} scalings only"
            )
            raise ValueError(
                f"{model.__class__.__name__} has its own {describe_own(ropes[layer_type])} scaling{why}; "
                "apply a position method alone"
            )
    new = {
        layer_type: frequency.rope_parameters(rope, 2 * inverse_frequencies(own_rotary, layer_type).shape[-1])
        if layer_type in scaled and rope.get("rope_type", "default") == "default"
        else copy.deepcopy(rope)
        for layer_type, rope in ropes.items()
    }
    config.rope_parameters = new.get(None, new)
    rotary = type(own_rotary)(config).to(inverse_frequencies(own_rotary, scaled[0]).device)
    for layer_type in scaled:
        if ropes[layer_type].get("rope_type", "default") != "default":
            _compose(rotary, own_rotary, layer_type, frequency, ropes[layer_type])
        _check(model, rotary, frequency, layer_type)
    return rotary, copy.deepcopy(config.rope_parameters)


def layer_ropes(rope_parameters: dict) -> dict[str | None, dict]:
    """``rope_parameters`` by layer type (Gemma 3: ``full_attention`` and ``sliding_attention``, each a base and
    a scaling of its own), or ``{None: rope_parameters}`` where one RoPE serves every layer."""
    per_type = {name: value for name, value in rope_parameters.items() if isinstance(value, dict)}
    return per_type or {None: rope_parameters}


def scaled_layer_types(ropes: dict[str | None, dict], rotary: nn.Module) -> list[str | None]:
    """The layer types a frequency method rescales: every one that ``rotary`` computes (a config may hold
    ``rope_parameters`` for types none of its layers has) but a sliding window's (``sliding_attention``, Zaya's
    ``hybrid_sliding``)."""
    return [
        layer_type
        for layer_type in ropes
        if layer_type is None or ("sliding" not in layer_type and hasattr(rotary, f"{layer_type}_inv_freq"))
    ]


def _compose(rotary: nn.Module, own_rotary: nn.Module, layer_type: str | None, frequency: Scaling, own: dict):
    """Write ``frequency`` composed over the model's own static scaling into ``rotary``'s buffers of
    ``layer_type`` (:meth:`Scaling.over`)."""
    prefix = "" if layer_type is None else f"{layer_type}_"
    own_scaling = cast(float, getattr(own_rotary, f"{prefix}attention_scaling"))
    inv_freq, scaling = frequency.over(inverse_frequencies(own_rotary, layer_type), own_scaling, own)
    setattr(rotary, f"{prefix}attention_scaling", scaling)
    for name in ("inv_freq", "original_inv_freq"):
        if hasattr(rotary, prefix + name):
            getattr(rotary, prefix + name).copy_(inv_freq)


def _check(model: PreTrainedModel, rotary: nn.Module, frequency: Scaling, layer_type: str | None) -> None:
    """Refuse frequencies ``rotary`` cannot compute or that over- or underflow (nothing to check on an empty
    model's meta tensors: lm-eval checks the method before loading)."""
    new_freq = inverse_frequencies(rotary, layer_type)
    prefix = "" if layer_type is None else f"{layer_type}_"
    scaling = cast(float, getattr(rotary, f"{prefix}attention_scaling"))
    if new_freq.device.type == "meta":
        return
    if problem := _fails_to_run(rotary, new_freq.device, layer_type):
        raise ValueError(
            f"{model.__class__.__name__}'s own rotary module cannot compute {frequency.name}'s frequencies "
            f"({problem}); apply a position method alone"
        )
    if not (torch.isfinite(new_freq).all() and (new_freq > 0).all() and math.isfinite(scaling)):
        raise ValueError(f"factor={frequency.factor!r} is out of range: the scaled RoPE frequencies over- or underflow")


def _fails_to_run(rotary: nn.Module, device, layer_type: str | None) -> str | None:
    """Why ``rotary`` fails to compute cos and sin for one position, or None: a family's rotary class may read keys of
    its own scaling from ``rope_parameters`` (PhiMoE's ``short_mscale``) that another scaling's parameters lack."""
    by_type = {} if layer_type is None else {"layer_type": layer_type}
    try:
        rotary(torch.zeros(1, 1, 2, device=device), torch.zeros(1, 1, dtype=torch.long, device=device), **by_type)
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as error:
        return f"{type(error).__name__}: {error}"
    return None


def install(model: PreTrainedModel, state, rotary: nn.Module, rope_parameters: dict) -> None:
    """Put ``rotary`` in place of the model's own rotary module (kept in ``state``, the applied state, for
    :func:`restore`) and record its ``rope_parameters`` in the config, so that saving the model keeps them."""
    config = model.config.get_text_config()
    parent, attribute = _parent_of(model, state.rotary)
    setattr(parent, attribute, rotary)
    state.replaced_rotary, state.replaced_rope_parameters, state.rotary = state.rotary, config.rope_parameters, rotary
    config.rope_parameters = rope_parameters


def restore(model: PreTrainedModel, state) -> None:
    """Put back the rotary module and ``rope_parameters`` :func:`install` replaced (nothing if it did not)."""
    if state.replaced_rotary is not None:
        parent, attribute = _parent_of(model, state.rotary)
        setattr(parent, attribute, state.replaced_rotary)
        model.config.get_text_config().rope_parameters = state.replaced_rope_parameters


def _own_rotary(model: PreTrainedModel, state) -> tuple[nn.Module, dict]:
    """The model's own rotary module and ``rope_parameters``, also while a frequency method replaces them."""
    if state is not None and state.replaced_rotary is not None:
        return state.replaced_rotary, state.replaced_rope_parameters
    rotary = find_rotary(model)
    assert rotary is not None  # apply refuses a model without one first
    return rotary, model.config.get_text_config().rope_parameters


def _parent_of(model: nn.Module, child: nn.Module) -> tuple[nn.Module, str]:
    path = next(name for name, module in model.named_modules() if module is child)
    parent_name, _, attribute = path.rpartition(".")
    return model.get_submodule(parent_name), attribute

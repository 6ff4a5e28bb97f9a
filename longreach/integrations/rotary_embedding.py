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
    """
    own_rotary, own = _own_rotary(model, state)
    if not isinstance(own, dict) or "rope_theta" not in own:
        raise ValueError(
            f"frequency methods need one set of rope_parameters; {model.__class__.__name__} has one per layer type "
            f"({', '.join(own)}): apply a position method without scaling"
        )
    config = copy.deepcopy(model.config.get_text_config())
    original = frequency.params.get("original_max_position_embeddings")
    if original is not None and getattr(config, "original_max_position_embeddings", None) is not None:
        # Phi-3 keeps the window outside rope_parameters, and transformers lets that one win over rope_parameters'
        config.original_max_position_embeddings = original
    own_type = own.get("rope_type", "default")
    if own_type != "default" and own_type not in STATIC_TYPES:
        raise ValueError(
            f"{model.__class__.__name__} has its own {describe_own(own)} scaling, whose frequencies "
            f"change during the forward pass: longreach composes no frequency method over it; "
            f"apply a position method alone"
        )
    own_freq = inverse_frequencies(own_rotary)
    if own_type == "default":
        config.rope_parameters = frequency.rope_parameters(own, 2 * own_freq.shape[-1])
        rotary = type(own_rotary)(config).to(own_freq.device)
    else:
        config.rope_parameters = copy.deepcopy(own)
        rotary = type(own_rotary)(config).to(own_freq.device)
        inv_freq, scaling = frequency.over(own_freq, _attention_scaling(own_rotary), own)
        rotary.attention_scaling = scaling  # type: ignore[assignment]  # torch types Module.__setattr__ too narrowly
        for name in ("inv_freq", "original_inv_freq"):
            if hasattr(rotary, name):
                getattr(rotary, name).copy_(inv_freq)
    new_freq = inverse_frequencies(rotary)
    if new_freq.device.type == "meta":  # an empty model (lm-eval checks the method before loading): no values
        pass
    elif problem := _fails_to_run(rotary, new_freq.device):
        raise ValueError(
            f"{model.__class__.__name__}'s own rotary module cannot compute {frequency.name}'s frequencies "
            f"({problem}); apply a position method alone"
        )
    elif not (torch.isfinite(new_freq).all() and (new_freq > 0).all() and math.isfinite(_attention_scaling(rotary))):
        raise ValueError(f"factor={frequency.factor!r} is out of range: the scaled RoPE frequencies over- or underflow")
    return rotary, copy.deepcopy(config.rope_parameters)


def _fails_to_run(rotary: nn.Module, device) -> str | None:
    """Why ``rotary`` fails to compute cos and sin for one position, or None: a family's rotary class may read keys of
    its own scaling from ``rope_parameters`` (PhiMoE's ``short_mscale``) that another scaling's parameters lack."""
    try:
        rotary(torch.zeros(1, 1, 2, device=device), torch.zeros(1, 1, dtype=torch.long, device=device))
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


# A rotary module's number, which nn.Module's __getattr__ types as Tensor | Module.
def _attention_scaling(rotary: nn.Module) -> float:
    return cast(float, rotary.attention_scaling)


def _parent_of(model: nn.Module, child: nn.Module) -> tuple[nn.Module, str]:
    path = next(name for name, module in model.named_modules() if module is child)
    parent_name, _, attribute = path.rpartition(".")
    return model.get_submodule(parent_name), attribute

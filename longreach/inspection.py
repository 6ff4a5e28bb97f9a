"""``longreach inspect``: what a model's layers do with positions, and what each method would do on it, from its config.

No weight is read. An empty model is built from the config on the meta device (its modules carry what the config sets
per layer: sliding windows, which layers rotate), its layouts are read as :func:`longreach.apply` reads them
(:mod:`.integrations.families`), and each method is applied to a copy of it: ``apply``'s own checks decide exact or
refused. ``exact`` stands for a verified family; the self-check (:mod:`.integrations.self_check`) still runs on the
weights when a method is applied to the real model.
"""

from __future__ import annotations

import copy
import itertools
from pathlib import Path

from .attention.layout import layer_ranges

# Each method with the parameters it needs to be built at all (DPE has no default frequency groups).
INSPECTED = {
    "string": {},
    "rerope": {},
    "self_extend": {},
    "dca": {},
    "dpe": {"group_scales": (8,), "top_k": None},
    "yarn": {},
    "ntk": {},
    "pi": {},
    "llama3": {},
    "dynamic": {},
    "dynamic_drop": {},
}
NOT_ATTENTION = {"linear_attention": "linear attention", "mamba": "Mamba", "conv": "convolution", "mlp": "MLP only"}


def inspect(model, training_window: int | None = None) -> str:
    """A model's attention layers, grouped where alike, and each method's verdict on it, as text.

    Args:
        model: a transformers model or config, a saved model's folder, a ``config.json``, a Hugging Face id (when the
            hub is reachable), ``"default"``, or a family of transformers' registry (``"glm4"``: its default
            config).
        training_window: ``L`` for the methods' defaults (default: the config's).

    Returns:
        One line per group of alike layers (attention kind, RoPE or not, pairing, rotated dimensions, base and
        scaling), then one line per method: exact, or refused and why.
    """
    from .integrations import families

    config = _config_of(model)
    empty = families.empty_model(config)
    text = config.get_text_config(decoder=True)
    name = families.model_type(empty)
    try:
        layouts = families.read_layouts(empty)
        verdict = f"verified ({families.VERIFIED[name].describe()})" if name in families.VERIFIED else ""
    except ValueError as refused:
        layouts, verdict = {}, f"refused: {refused}"
    lines = [f"{name}: {text.num_hidden_layers} layers, L = {_window(config, training_window)}; {verdict}".rstrip()]
    described = [(index, _describe_layer(text, index, layouts.get(index))) for index in range(text.num_hidden_layers)]
    for line, group in itertools.groupby(sorted(described, key=lambda item: item[1]), key=lambda item: item[1]):
        indices = [index for index, _ in group]
        lines.append(f"  layers {layer_ranges(indices)} ({len(indices)}): {line}")
    if layouts:
        lines.append("methods:")
        lines += [f"  {method:<13} {_verdict(empty, method, training_window)}" for method in INSPECTED]
    return "\n".join(lines)


def _config_of(model):
    """The config ``model`` names or holds."""
    from transformers import CONFIG_MAPPING, AutoConfig, PretrainedConfig

    from . import models

    if isinstance(model, PretrainedConfig):
        return copy.deepcopy(model)
    if hasattr(model, "config") and isinstance(model.config, PretrainedConfig):
        return copy.deepcopy(model.config)
    if not isinstance(model, str):
        raise ValueError(f"model={model!r} must be a model, a config, a folder, a config.json or a family's name")
    if models.converts(model):  # a bundled model, or a .gguf file
        return models.load_config(model)
    if Path(model).is_file():
        return AutoConfig.from_pretrained(str(Path(model).parent)) if model.endswith(".json") else _not_a_config(model)
    if not Path(model).exists() and model in CONFIG_MAPPING:
        return CONFIG_MAPPING[model]()
    return models.load_config(model)


def _not_a_config(path: str):
    raise ValueError(f"model={path} is a file but not a config.json; give the folder that holds its config.json")


def _window(config, training_window: int | None) -> int:
    from .integrations.transformers import training_window as window_of

    return training_window or window_of(config)


def _describe_layer(text, index: int, layout) -> str:
    """One layer in words: its attention, its RoPE, its frequencies."""
    layer_types = getattr(text, "layer_types", None)
    layer_type = layer_types[index] if isinstance(layer_types, list) and index < len(layer_types) else None
    if layer_type in NOT_ATTENTION:
        return f"{NOT_ATTENTION[layer_type]}, no softmax attention: untouched by every method"
    kind = (layer_type or "full_attention").replace("_", " ")
    if layer_type in ("sliding_attention", "hybrid_sliding") and getattr(text, "sliding_window", None):
        kind += f" (window {text.sliding_window})"
    if layout is None:
        return kind
    if not layout.rotated:
        return f"{kind}; no RoPE: stock under every method"
    return f"{kind}; {layout.describe()}; {_rope(text, layout.layer_type)}"


def _rope(text, layer_type: str | None) -> str:
    """The layer's base and scaling, from ``rope_parameters`` (one set, or one per layer type)."""
    parameters = getattr(text, "rope_parameters", None) or {}
    if layer_type is not None and isinstance(parameters.get(layer_type), dict):
        parameters = parameters[layer_type]
    theta = parameters.get("rope_theta", getattr(text, "rope_theta", "?"))
    kind = parameters.get("rope_type", "default")
    extra = ", ".join(
        f"{key}={value}"
        for key, value in parameters.items()
        if key not in ("rope_theta", "rope_type", "partial_rotary_factor", "type")
        and not isinstance(value, (list, dict))
    )
    base = f"base {theta:g}" if isinstance(theta, (int, float)) else f"base {theta}"
    return base if kind == "default" else f"{base}, {kind} scaling ({extra})"


def _verdict(empty, method: str, training_window: int | None) -> str:
    """What applying ``method`` (its defaults) to the empty model would do: ``exact: <resolved method>`` or
    ``refused: <why>`` (a refused ``apply`` changes nothing; an applied one is removed again)."""
    from .integrations.transformers import apply, describe, remove

    try:
        apply(empty, method, training_window=training_window, **INSPECTED[method])
    except ValueError as refused:
        return f"refused: {refused}"
    verdict = f"exact: {describe(empty)}"
    remove(empty)
    return verdict

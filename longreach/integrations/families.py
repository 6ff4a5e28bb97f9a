"""Every family of transformers' causal language models, classified: verified (its rotary layout, read per layer) or
refused (one line saying why).

A family is verified when tests/test_families.py shows every position method exact on it against the float64
reference (prefill, a padded batch, generation with the dynamic and the static cache). Its :class:`Family` says what
its code does and its config does not: how its pairs are laid out, whether the last dimensions rotate (multi-head
latent attention), and which layers rotate at all, by the very condition its attention's ``forward`` tests. The
self-check (:mod:`.self_check`) then holds each model to that layout with its own code. A family in neither table,
such as one added to transformers after this release, is refused until it is classified.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from torch import nn

from ..attention.layout import Layout
from ..attention.rotary import inverse_frequencies
from . import self_check
from .rotary_embedding import find_rotary, language_model


def every_layer(module: nn.Module, layer_type: str | None) -> bool:
    return True


def use_rope(module: nn.Module, layer_type: str | None) -> bool:
    """SmolLM3: ``if self.use_rope`` (the config's ``no_rope_layers``)."""
    return bool(module.use_rope)


def sliding_layers(module: nn.Module, layer_type: str | None) -> bool:
    """Cohere2: ``if self.sliding_window is not None`` (global layers have no RoPE)."""
    return module.sliding_window is not None


def sliding_layers_or_forced(module: nn.Module, layer_type: str | None) -> bool:
    """Cohere2 MoE: ``if self.sliding_window is not None or self.force_rope``."""
    return module.sliding_window is not None or bool(module.force_rope)


def sliding_layers_if_any(module: nn.Module, layer_type: str | None) -> bool:
    """EXAONE 4: ``if self.sliding_window is None or self.is_sliding`` (with a sliding window, global layers have
    none)."""
    return module.sliding_window is None or bool(module.is_sliding)


def local_layers(module: nn.Module, layer_type: str | None) -> bool:
    """AFMoE: ``if self.is_local_attention``."""
    return bool(module.is_local_attention)


def sliding_type(module: nn.Module, layer_type: str | None) -> bool:
    """LARA mini: its model hands RoPE to ``sliding_attention`` layers only."""
    return layer_type == "sliding_attention"


@dataclass(frozen=True)
class Family:
    """What a family's attention code does with RoPE: ``pairs`` (``half`` or ``interleaved``), ``last`` (the last
    dimensions rotate: multi-head latent attention), and ``rotates(module)``: whether an attention layer applies RoPE
    at all, by the condition its ``forward`` tests (given the layer's module and its type in ``layer_types``)."""

    pairs: str = "half"
    last: bool = False
    rotates: Callable[[nn.Module, str | None], bool] = every_layer

    def describe(self) -> str:
        """e.g. ``"interleaved pairs, first dims"``."""
        return f"{self.pairs} pairs, {'last' if self.last else 'first'} dims"


RULES = {  # each rule in words, for ``longreach inspect`` and docs/methods.md
    every_layer: "none",
    use_rope: "where no_rope_layers is 0",
    sliding_layers: "global layers",
    sliding_layers_or_forced: "global layers, unless force_rope",
    sliding_layers_if_any: "global layers, when the model has a sliding window",
    local_layers: "global layers",
    sliding_type: "full_attention layers",
}

HALF = Family()
INTERLEAVED = Family("interleaved")
LATENT = Family(last=True)  # multi-head latent attention: qk_rope_head_dim rotated after qk_nope_head_dim

VERIFIED: dict[str, Family] = {
    **dict.fromkeys(
        [
            "apertus",
            "apertus1p5_text",
            "arcee",
            "aria_text",
            "bamba",
            "bitnet",
            "cwm",
            "diffllama",
            "emu3",
            "emu3_text_model",
            "exaone",
            "falcon_h1",
            "flex_olmo",
            "fuyu",
            "gemma",
            "gemma3",
            "gemma3_text",
            "gemma4",
            "gemma4_text",
            "gemma4_unified_text",
            "glm4_moe",
            "got_ocr2",
            "gpt_neox",
            "granite",
            "granitemoe",
            "granitemoehybrid",
            "granitemoeshared",
            "hy_v3",
            "hyperclovax",
            "internlm3",
            "iquestcoder",
            "jais2",
            "jetmoe",
            "laguna",
            "lfm2",
            "lfm2_moe",
            "lfm3",
            "llama",
            "mellum",
            "minimax",
            "minimax_m2",
            "minimax_m3_vl_text",
            "ministral",
            "ministral3",
            "mistral",
            "mixtral",
            "modernbert-decoder",
            "moss_transcribe_diarize",
            "nemotron",
            "olmo",
            "olmo2",
            "olmo3",
            "olmo_hybrid",
            "olmoe",
            "persimmon",
            "phi",
            "phi3",
            "phi4_multimodal",
            "phimoe",
            "qwen2",
            "qwen2_moe",
            "qwen3",
            "qwen3_5",
            "qwen3_5_moe",
            "qwen3_5_moe_text",
            "qwen3_5_text",
            "qwen3_moe",
            "qwen3_next",
            "sarvam_moe",
            "seed_oss",
            "solar_open",
            "stablelm",
            "starcoder2",
            "zaya",
        ],  # fmt: skip
        HALF,
    ),
    **dict.fromkeys(["cohere", "ernie4_5", "ernie4_5_moe", "glm", "glm4", "helium"], INTERLEAVED),
    **dict.fromkeys(["axk1", "deepseek_v3", "glm4_moe_lite", "minicpm3", "sarvam_mla", "youtu"], LATENT),
    "deepseek_v2": Family("interleaved", last=True),  # its own complex rotation of the last qk_rope_head_dim dims
    "smollm3": Family(rotates=use_rope),
    "cohere2": Family("interleaved", rotates=sliding_layers),
    "cohere2_moe": Family("interleaved", rotates=sliding_layers_or_forced),
    "exaone4": Family(rotates=sliding_layers_if_any),
    "exaone_moe": Family(rotates=sliding_layers_if_any),
    "kolibri1": Family(rotates=sliding_layers_if_any),
    "lara_mini": Family(rotates=sliding_type),
    "afmoe": Family(rotates=local_layers),
}
# fmt: off
NO_ROPE = "it has no rotary position embedding (learned, absolute, relative or ALiBi positions, or none)"
OWN_ROTATION = "it turns queries and keys by a position table of its own, not a rotary module longreach can read"
OWN_ATTENTION = "its attention does not go through transformers' attention interface, so longreach cannot reach it"
SINKS = "its attention adds learned sinks (s_aux), which longreach's attention does not compute"
SOFTCAP = "its attention caps its logits (attn_logit_softcapping), which longreach's attention does not compute"
SPARSE = (
    "its layers attend to the keys a learned indexer selects (DeepSeek Sparse Attention), which longreach's kernels "
    "do not compute"
)
NOT_BUILT = "not verified: no tiny model of it builds from its config class in transformers 5.24, so no test ran it"
REFUSED: dict[str, str] = {
    **dict.fromkeys(
        [
            "bart", "bert", "bert-generation", "big_bird", "bigbird_pegasus", "biogpt", "blenderbot",
            "blenderbot-small", "bloom", "camembert", "cpmant", "ctrl", "data2vec-text", "electra", "ernie",
            "falcon_mamba", "git", "gpt-sw3", "gpt2", "gpt_bigcode", "gpt_neo", "inkling2_loop_text", "inkling2_text",
            "inkling_text", "jamba", "kimi_linear", "mamba", "mamba2", "marian", "mbart", "megatron-bert", "mpt",
            "musicgen", "musicgen_melody", "mvp", "nemotron_h", "openai-gpt", "opt", "pegasus", "plbart",
            "prophetnet", "reformer", "rembert", "roberta", "roberta-prelayernorm", "roc_bert", "rwkv", "trocr",
            "whisper", "xglm", "xlm", "xlm-roberta", "xlm-roberta-xl", "xlnet", "xlstm", "xmod", "zamba", "zamba2",
        ],
        NO_ROPE,
    ),
    **dict.fromkeys(["codegen", "gptj", "roformer"], OWN_ROTATION),
    **dict.fromkeys(["falcon", "gpt_neox_japanese"], OWN_ATTENTION),
    **dict.fromkeys(["flint", "gpt_oss", "granite_swa", "granitemoe_swa", "mimo_v2_flash"], SINKS),
    **dict.fromkeys(["gemma2", "vaultgemma"], SOFTCAP),
    **dict.fromkeys(
        ["axk2", "deepseek_v32", "dots3_note", "dots3_note_text", "glm_moe_dsa", "hy_v4", "qwen4_exp",
         "qwen4_exp_text"],
        SPARSE,
    ),
    **dict.fromkeys(
        ["bailing_hybrid", "blt", "cohere_compass_text", "dbrx", "dots1", "gemma3n", "gemma3n_text",
         "gemma4_assistant", "gemma4_unified_assistant"],
        NOT_BUILT,
    ),
    "beam": "its global layers have no RoPE and scale their queries by position, which longreach does not compute",
    "deepseek_v4": "its layers attend over compressed keys, which longreach's kernels do not compute",
    "doge": "its attention adds a learned dynamic mask, which longreach's attention does not compute",
    "dory": "its recurrent loops attend over keys shared across loops, which longreach has not verified",
    "gemma4_unified": (
        "its image tokens attend both ways (use_bidirectional_attention), which longreach's causal kernels do not "
        "compute; apply a method to its text model, gemma4_unified_text"
    ),
    **dict.fromkeys(
        ["hunyuan_v1_dense", "hunyuan_v1_moe"],
        "it normalises queries and keys after RoPE with a weight per dimension, which does not commute with a "
        "rotation: no method can move them",
    ),
    "hrm_text": "its recurrent stacks run an attention layer more than once a token, which longreach has not verified",
    **dict.fromkeys(
        ["llama4", "llama4_text"],
        "its RoPE layers attend within chunks (attention_chunk_size), which longreach's kernels do not compute",
    ),
    "longcat_flash": "each of its layers holds two latent-attention sublayers, which longreach has not verified",
    "mllama": "its cross-attention layers attend to image features, which longreach's causal kernels do not compute",
    "moshi": "not verified: its decoding steps differ from the float64 reference in longreach's test",
    "nanochat": "it turns its pairs the other way (rotate_half with flipped signs), a layout longreach does not state",
    "recurrent_gemma": "the self-check finds its rotation 0.9% away from every layout longreach states",
}
# fmt: on

# Layer types that are not softmax attention over RoPE'd keys: their layers never call the attention function.
NOT_ATTENTION = {"linear_attention", "mamba", "conv", "mlp", "moe"}


def classify(model_type: str) -> Family:
    """The verified family of ``model_type``; ``ValueError`` (one line) for a refused or an unclassified one."""
    if model_type in VERIFIED:
        return VERIFIED[model_type]
    if model_type in REFUSED:
        raise ValueError(f"{model_type}: {REFUSED[model_type]}; docs/methods.md#families lists what runs")
    raise ValueError(
        f"{model_type} is not a family longreach has verified (transformers may have added it after this release); "
        "docs/methods.md#families lists the verified ones"
    )


def model_type(model: nn.Module) -> str:
    """The family's name: the model's own config's ``model_type`` (a multimodal model's, not its text part's)."""
    return str(getattr(cast(Any, model).config, "model_type", type(model).__name__))


def attention_modules(model: nn.Module) -> dict[int, nn.Module]:
    """Each attention layer's module, by its ``layer_idx``: the modules named ``...Attention`` that carry one, but for
    the layer types that are not attention (linear attention, Mamba, convolutions)."""
    layer_types = getattr(_text_config(model), "layer_types", None)
    found: dict[int, nn.Module] = {}
    for module in language_model(model).modules():  # not a vision tower's attention, which has layer indices too
        index = getattr(module, "layer_idx", None)
        if not isinstance(index, int) or not type(module).__name__.endswith("Attention") or index in found:
            continue
        if isinstance(layer_types, list) and index < len(layer_types) and layer_types[index] in NOT_ATTENTION:
            continue
        found[index] = module
    return found


def read_layouts(model: nn.Module) -> dict[int, Layout]:
    """Each attention layer's rotary layout (:func:`read`), held to the model's own code by the self-check
    (:mod:`.self_check`; not on an empty model, which has no values to run): ``ValueError`` in one line for a model
    without RoPE, a family not verified, or a model whose rotation departs from its layout."""
    rotary = find_rotary(model)
    if rotary is None:
        raise ValueError(
            f"{model.__class__.__name__} has no rotary position embedding (no module with an inv_freq buffer); "
            "longreach's methods work on RoPE models: docs/methods.md#families lists the families verified exact"
        )
    layouts = read(model, rotary)
    if _has_values(model):  # the rotary module the forward runs, a frequency method's too
        self_check.check(
            model,
            layouts,
            lambda layout: inverse_frequencies(rotary, layout.layer_type),
            model_type(model),
            _unchanging_window(_text_config(model)),
        )
    return layouts


def empty_model(config) -> nn.Module:
    """The causal language model ``config`` describes, on the meta device: its modules carry what the config sets per
    layer (sliding windows, which layers rotate), and no values. ``ValueError`` (one line) where transformers builds
    none from it."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        try:
            return AutoModelForCausalLM.from_config(copy.deepcopy(config))
        except ValueError as error:
            raise ValueError(
                f"{config.model_type}: transformers builds no causal language model from it ({error})"
            ) from None


CONFIG_LAYOUTS: dict[int, tuple[object, dict[int, Layout]]] = {}  # per config (its id): the config and its layouts


def config_layouts(config) -> dict[int, Layout]:
    """Each attention layer's layout of the model ``config`` describes, from its :func:`empty_model`, read once per
    config object (vLLM's engine reads it in each process: about 0.05 s for an 8B model's config)."""
    held = CONFIG_LAYOUTS.get(id(config))
    if held is None or held[0] is not config:
        held = CONFIG_LAYOUTS[id(config)] = (config, read_layouts(empty_model(config)))
    return held[1]


def _has_values(model: nn.Module) -> bool:
    """Whether ``model`` can run a forward: not an empty (meta) model, as lm-eval's check and ``inspect`` build, but
    one whose weights are somewhere, on a device or offloaded by accelerate (``hf_device_map``)."""
    return getattr(model, "hf_device_map", None) is not None or any(
        parameter.device.type != "meta" for parameter in model.parameters()
    )


def _unchanging_window(config) -> int:
    """The positions at which no dynamic RoPE changes its frequencies: below ``original_max_position_embeddings``
    where a scaling has one (LongRoPE switches factors above it), else the model's window."""
    window = int(getattr(config, "max_position_embeddings", None) or 4096)
    rope = getattr(config, "rope_parameters", None) or {}
    originals = [p.get("original_max_position_embeddings") for p in [rope, *rope.values()] if isinstance(p, dict)]
    originals.append(getattr(config, "original_max_position_embeddings", None))
    return min([window, *(int(o) for o in originals if o)])


def read(model: nn.Module, rotary: nn.Module) -> dict[int, Layout]:
    """Each attention layer's :class:`~longreach.attention.layout.Layout`, read from the model's config and modules
    (no forward pass: an empty model on the meta device reads the same). ``ValueError`` for a family that is not
    verified."""
    name = model_type(model)
    family = classify(name)
    config = _text_config(model)
    layer_types = getattr(config, "layer_types", None)
    layouts = {}
    for index, module in sorted(attention_modules(model).items()):
        head_dim = _head_dim(module, config)
        layer_type = layer_types[index] if isinstance(layer_types, list) and index < len(layer_types) else None
        if not family.rotates(module, layer_type):
            layouts[index] = Layout(False, head_dim)
            continue
        dims = 2 * _frequencies(rotary, layer_type, name, index).shape[-1]
        own_type = layer_type if hasattr(rotary, f"{layer_type}_inv_freq") else None
        start = head_dim - dims if family.last else 0
        layouts[index] = Layout(True, head_dim, family.pairs, start, dims, own_type)
    if not layouts:
        raise ValueError(f"{name}: no attention layer found (no module named ...Attention with a layer_idx)")
    return layouts


def _head_dim(module: nn.Module, config) -> int:
    """The dimensions of the layer's queries and keys (multi-head latent attention: ``qk_head_dim``)."""
    for name in ("qk_head_dim", "head_dim", "head_size"):
        value = getattr(module, name, None)
        if isinstance(value, int):
            return value
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def _frequencies(rotary: nn.Module, layer_type: str | None, name: str, index: int):
    own = getattr(rotary, f"{layer_type}_inv_freq", None) if layer_type else None
    if own is not None:
        return own
    if not hasattr(rotary, "inv_freq"):
        raise ValueError(
            f"{name}: layer {index} is of type {layer_type!r}, and the rotary module has frequencies for other types "
            "only"
        )
    return inverse_frequencies(rotary)


def _text_config(model: nn.Module):
    config = cast(Any, model).config  # a transformers model's (nn.Module's __getattr__ types it as Tensor | Module)
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config

"""A tiny random model of any family in transformers' registry of causal language models, built from its config class
with small sizes (tests/test_families.py walks the whole registry with it).

The config's defaults are a released model's sizes; every size this module knows the name of is made small, in the
text config and in every sub-config (a multimodal model's vision tower too). Lists of per-layer settings keep their
first layers, as many as it takes for every kind of layer in the list to appear (at least 4, at most 8).
"""

from __future__ import annotations

import contextlib
import copy
import warnings

import torch
import transformers
from transformers import CONFIG_MAPPING

SIZES = dict(
    hidden_size=64,
    d_model=64,
    n_embd=64,
    intermediate_size=96,
    ffn_hidden_size=96,
    n_inner=96,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    expert_intermediate_size=32,
    num_attention_heads=4,
    n_head=4,
    num_heads=4,
    num_key_value_heads=2,
    num_kv_heads=2,
    head_dim=16,
    vocab_size=97,
    max_position_embeddings=96,
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    moe_num_experts=4,
    num_experts_per_tok=2,
    moe_k=2,
    top_k=2,
    n_shared_experts=1,
    num_shared_experts=1,
    kv_lora_rank=16,
    q_lora_rank=24,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=16,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    sliding_window=24,
    attention_chunk_size=24,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    mamba_n_heads=8,
    mamba_d_head=16,
    mamba_d_state=16,
    mamba_d_ssm=128,
    num_layers_per_stack=2,
    vocab_size_per_layer_input=97,
    hidden_size_per_layer_input=16,
)
# Sizes a config may leave None (its model then derives them, or fails without them).
SET_WHEN_NONE = {"head_dim", "num_key_value_heads", "num_experts_per_tok", "n_group", "topk_group"}
# Families whose default config has no attention layer among its first ones, or needs a setting named otherwise.
OVERRIDES: dict[str, dict] = {
    "bamba": {"attn_layer_indices": [1, 3]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention", "conv", "full_attention"]},
    "granitemoehybrid": {
        "position_embedding_type": "rope",
        "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
    },
    "dots1": {"n_routed_experts": 4},
}
MAX_PARAMETERS = 15_000_000
SPECIAL_TOKENS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
LAYER_COUNTS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers", "encoder_layers", "depth")
LAYER_LISTS = ("layer_types", "no_rope_layers", "mlp_layer_types")


def tiny_config(model_type: str):
    """The config of ``model_type`` with small sizes."""
    config = CONFIG_MAPPING[model_type]()
    text = config.get_text_config(decoder=True)
    for name in getattr(config, "sub_configs", None) or {}:
        sub = getattr(config, name, None)
        if sub is not None and hasattr(sub, "to_dict") and sub is not text:
            _shrink(sub, 2)
    for name, value in OVERRIDES.get(model_type, {}).items():
        setattr(text, name, value)
    _shrink(text, 4)
    return config


def tiny_registry_model(model_type: str, dtype=torch.float32) -> transformers.PreTrainedModel:
    """A random model of ``model_type`` from :func:`tiny_config`, with SDPA (eager where the family has no other);
    ``ValueError`` where the sizes this module makes small leave it large."""
    config = tiny_config(model_type)
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        size = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config)).parameters())
    if size > MAX_PARAMETERS:
        raise ValueError(f"{model_type}: {size:,} parameters at the sizes this module knows how to make small")
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa")
        except ValueError as error:
            if "does not support an attention implementation" not in str(error):
                raise
            model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="eager")
    with torch.no_grad():  # weights a family initialises to one constant (norms, biases, temperatures) made random
        for parameter in model.parameters():
            if parameter.numel() and bool((parameter == parameter.flatten()[0]).all()):
                parameter.add_(0.1 * torch.randn_like(parameter))
    return model.to(dtype).eval()


def _shrink(config, layers: int) -> None:
    values = config.to_dict()
    small = {name: size for name, size in SIZES.items() if _size(values.get(name, "absent"), name)}
    if "qk_rope_head_dim" in values:  # multi-head latent attention: head_dim is the rotary part's
        latent = {
            "head_dim": SIZES["qk_rope_head_dim"],
            "qk_head_dim": SIZES["qk_rope_head_dim"] + SIZES["qk_nope_head_dim"],
            "num_key_value_heads": SIZES["num_attention_heads"],  # keys are made per query head
        }
        small |= {name: size for name, size in latent.items() if name in values}
    if isinstance(values.get("initializer_range"), float):  # weights ten times the usual: attention that is not flat
        small["initializer_range"] = 0.2
    small |= {name: token for name, token in SPECIAL_TOKENS.items() if values.get(name) is not None}
    kinds = getattr(config, "layer_types", None)
    count = layers if not (isinstance(kinds, list) and kinds) else max(layers, *(kinds.index(k) + 1 for k in kinds))
    small |= {name: min(count, 8) for name in LAYER_COUNTS if isinstance(getattr(config, name, None), int)}
    small |= {
        name: held[: min(count, 8)] for name in LAYER_LISTS if isinstance(held := getattr(config, name, None), list)
    }
    for name, value in small.items():
        with contextlib.suppress(AttributeError, TypeError, ValueError):  # some sizes are read-only, derived ones
            setattr(config, name, value)


def _size(held, name: str) -> bool:
    """Whether the config's ``held`` value of ``name`` is a size to make small."""
    return (isinstance(held, int) and not isinstance(held, bool)) or (held is None and name in SET_WHEN_NONE)

"""Tiny models of several RoPE families, built from configs (no downloads)."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

COMMON = dict(
    vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=96, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)
FAMILIES = {
    "llama": (transformers.LlamaConfig, {}),
    "qwen2": (transformers.Qwen2Config, {}),
    "mistral": (transformers.MistralConfig, {"sliding_window": None}),
    "qwen3": (transformers.Qwen3Config, {"head_dim": 16}),
    "gemma": (transformers.GemmaConfig, {"head_dim": 16}),
    "gemma3": (transformers.Gemma3TextConfig, {"head_dim": 16, "sliding_window": 24, "layer_types": ["sliding_attention", "full_attention"]}),
    "phi3": (transformers.Phi3Config, {"partial_rotary_factor": 0.5, "num_key_value_heads": 4}),
}


def tiny_model(family: str, dtype=torch.float32, **overrides) -> transformers.PreTrainedModel:
    config_class, extra = FAMILIES[family]
    config = config_class(**{**COMMON, **extra, **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa")
    return model.to(dtype).eval()


@pytest.fixture(params=sorted(FAMILIES))
def family(request) -> str:
    return request.param

"""Tiny models of several RoPE families, built from configs (no downloads)."""

from __future__ import annotations

import copy
import os

import pytest
import torch

if (
    not torch.cuda.is_available()
):  # the fused Triton kernel runs under Triton's interpreter (read when a kernel is defined)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import transformers  # noqa: E402

COMMON = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=96,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
FAMILIES = {
    "llama": (transformers.LlamaConfig, {}),
    "qwen2": (transformers.Qwen2Config, {}),
    "mistral": (transformers.MistralConfig, {"sliding_window": None}),
    "qwen3": (transformers.Qwen3Config, {"head_dim": 16}),
    "gemma": (transformers.GemmaConfig, {"head_dim": 16}),
    "gemma3": (
        transformers.Gemma3TextConfig,
        {"head_dim": 16, "sliding_window": 24, "layer_types": ["sliding_attention", "full_attention"]},
    ),
    "phi3": (transformers.Phi3Config, {"partial_rotary_factor": 0.5, "num_key_value_heads": 4}),
}


def tiny_model(family: str, dtype=torch.float32, **overrides) -> transformers.PreTrainedModel:
    config_class, extra = FAMILIES[family]
    config = config_class(**{**COMMON, **extra, **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa")
    return model.to(dtype).eval()


def native_builds() -> bool:
    """Whether the C++ CPU kernel builds and loads here (auto takes it then; else the tiled kernel, with a warning)."""
    from longreach.attention import native

    try:
        native.extension()
    except native.BuildError:
        return False
    return True


@pytest.fixture(params=sorted(FAMILIES))
def family(request) -> str:
    return request.param


def byte_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A byte-level tokenizer (256 bytes + 4 specials) with a chat template; vocab fits TINY_VOCAB."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<|im_start|>": 3, **{ch: i + 4 for i, ch in enumerate(alphabet)}}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
        "{{ '<|im_start|>assistant\n' }}"
    )
    return tokenizer


TINY_VOCAB = 260

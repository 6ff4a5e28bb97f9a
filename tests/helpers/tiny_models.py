"""Tiny models of several RoPE families, built from configs (no downloads), and what tests save them with.

:func:`tiny_model` (hidden size 64, 2 layers, vocabulary 97) for the transformers tests; :func:`byte_tokenizer` and
:func:`text_model` for the tests that need text; :func:`save_tiny_llama` (the real SmolLM2 tokenizer, L = 64) for
lm-eval and torchrun; :func:`save_vllm_model` (head dim 64, the smallest vLLM's CPU kernel takes) for the vLLM tests.
"""

from __future__ import annotations

import copy

import torch
import transformers

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


def tiny_config(family: str, **overrides) -> transformers.PretrainedConfig:
    config_class, extra = FAMILIES[family]
    return config_class(**{**COMMON, **extra, **overrides})


def tiny_model(family: str, dtype=torch.float32, **overrides) -> transformers.PreTrainedModel:
    return model_from_config(tiny_config(family, **overrides), dtype)


def model_from_config(config: transformers.PretrainedConfig, dtype=torch.float32) -> transformers.PreTrainedModel:
    """The model of ``config`` with seed-0 weights, SDPA attention, in eval mode."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa")
    return model.to(dtype).eval()


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

# Qwen3's thinking switch in a chat template: the generation prompt closes an empty thinking block when
# enable_thinking is false, and leaves the model to think otherwise.
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
    "{% endif %}"
)


def thinking_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """:func:`byte_tokenizer` with :data:`THINKING_TEMPLATE`, a chat template with a thinking switch."""
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = THINKING_TEMPLATE
    return tokenizer


def text_model(window: int = 1024) -> tuple[transformers.PreTrainedModel, transformers.PreTrainedTokenizerFast]:
    """``(model, tokenizer)``: a tiny Llama with L = ``window`` over :func:`byte_tokenizer`'s vocabulary, and that
    tokenizer, as the runner's ``loaded`` takes them."""
    return tiny_model("llama", vocab_size=TINY_VOCAB, max_position_embeddings=window), byte_tokenizer()


def save_tiny_llama(folder, window: int = 64, **overrides) -> None:
    """A tiny Llama with L = ``window`` and the real SmolLM2 tokenizer's vocabulary and special tokens, saved with it
    in ``folder`` (tests/test_lm_eval.py, tests/test_vllm_lm_eval.py, tests/test_distributed.py)."""
    from transformers import AutoTokenizer

    from longreach import models

    tokenizer = AutoTokenizer.from_pretrained(models.default_path())
    model = tiny_model(
        "llama",
        vocab_size=len(tokenizer),
        max_position_embeddings=window,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **overrides,
    )
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


# The families of save_vllm_model (their config classes by name: the compat environments' older transformers lacks
# the newest), with what each sets over the defaults: a layout of RoPE each (docs/vllm.md)
VLLM_FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {}),
    "mistral": ("MistralConfig", {"sliding_window": 128}),
    "phi3": ("Phi3Config", {"partial_rotary_factor": 0.5, "pad_token_id": 0}),
    # interleaved pairs over half of each head's dimensions
    "glm4": ("Glm4Config", {"partial_rotary_factor": 0.5, "pad_token_id": 0}),
    "ernie4_5": ("Ernie4_5Config", {"pad_token_id": 0}),  # interleaved pairs
    # interleaved pairs; its global layer has no RoPE
    "cohere2": ("Cohere2Config", {
        "sliding_window": 512, "layer_types": ["sliding_attention", "full_attention"], "pad_token_id": 0,
    }),
    # half pairs; its global layer has no RoPE
    "exaone4": ("Exaone4Config", {
        "sliding_window": 512, "layer_types": ["sliding_attention", "full_attention"], "pad_token_id": 0,
    }),
    "smollm3": ("SmolLM3Config", {"no_rope_layers": [1, 0], "pad_token_id": 0}),  # layer 1 without RoPE
    # a linear-attention (Gated DeltaNet) layer, then an attention layer rotating a quarter of each head
    "qwen3_next": ("Qwen3NextConfig", {
        "layer_types": ["linear_attention", "full_attention"], "pad_token_id": 0, "partial_rotary_factor": 0.25,
        "linear_key_head_dim": 64, "linear_value_head_dim": 64, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64,
    }),
    "qwen3_5": ("Qwen3_5TextConfig", {
        "layer_types": ["linear_attention", "full_attention"], "pad_token_id": 0, "partial_rotary_factor": 0.25,
        "linear_key_head_dim": 64, "linear_value_head_dim": 64, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    }),
    # a RoPE per layer type, a sliding layer then a full one; vLLM serves it by its transformers backend
    "olmo3": ("Olmo3Config", {
        "sliding_window": 512, "layer_types": ["sliding_attention", "full_attention"], "pad_token_id": 0,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 500000.0},
        },
    }),
    # sliding layers, and full ones with heads of 128 and proportional RoPE over a quarter of them; the last two
    # layers read the first two's KV cache (E2B's and E4B's num_kv_shared_layers)
    "gemma4": ("Gemma4TextConfig", {
        "num_hidden_layers": 4, "sliding_window": 512, "num_kv_shared_layers": 2, "pad_token_id": 0,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        "per_layer_config": {"01": {"head_dim": 128}, "03": {"head_dim": 128}}, "hidden_size_per_layer_input": 16,
        "vocab_size_per_layer_input": 4096, "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
        },
    }),
}  # fmt: skip


def save_vllm_model(path, family: str = "llama", rope: dict | None = None, **config) -> str:
    """A random 2-layer model of ``family`` (:data:`VLLM_FAMILIES`: Llama; Qwen2: biased q, k, v; Qwen3: q and k normed;
    Mistral: a sliding window of 128 keys; Phi-3: fused q, k, v and half of each head rotary, as Phi-4-mini's three
    quarters; and the other layouts of RoPE) saved to ``path``, its RoPE plain or with ``rope``'s scaling, with
    ``config``'s settings (over the defaults below): head dim 64, vLLM's CPU kernel's smallest (tests/test_vllm.py,
    tests/test_vllm_eval.py)."""
    class_name, own = VLLM_FAMILIES[family]
    config_class = getattr(transformers, class_name)
    torch.manual_seed(0)
    partial = {"partial_rotary_factor": own["partial_rotary_factor"]} if "partial_rotary_factor" in own else {}
    defaults = dict(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, **partial, **(rope or {})},
    )
    settings = {**defaults, **own, **config}
    transformers.AutoModelForCausalLM.from_config(config_class(**settings)).save_pretrained(path)
    return str(path)

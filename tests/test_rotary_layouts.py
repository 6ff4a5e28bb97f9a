"""Rotary layouts read from the model: the permutation into the kernels' layout, layers without RoPE, the self-check
that holds a model to its layout with its own code, and ``longreach inspect``."""

import pytest
import torch
import transformers
from helpers.registry_models import tiny_config, tiny_registry_model
from helpers.tiny_models import COMMON, tiny_model
from transformers.models.llama import modeling_llama

import longreach
from longreach.attention import kernel, reference
from longreach.attention.layout import Layout, to_kernel
from longreach.integrations import self_check, vllm
from longreach.integrations.families import read_layouts
from longreach.integrations.rotary_embedding import find_rotary

STRING = dict(shift=20, local_window=4)


@pytest.mark.parametrize(
    "layout",
    [
        Layout(True, 16, "half", 0, 16),
        Layout(True, 16, "interleaved", 0, 8),
        Layout(True, 24, "half", 16, 8),
        Layout(True, 24, "interleaved", 8, 16),
    ],
)
def test_a_permuted_layout_attends_exactly_as_its_own(layout):
    """The reference turns each pair where the layout puts it; the kernels, given the queries and keys permuted into
    their layout, attend exactly as it does (one permutation of both leaves every dot product as it was)."""
    generator = torch.Generator().manual_seed(0)
    query, key = (torch.randn(1, 4, 12, layout.head_dim, generator=generator, dtype=torch.float64) for _ in range(2))
    value = torch.randn(1, 4, 12, 8, generator=generator, dtype=torch.float64)
    inv_freq = 1.0 / 100 ** (torch.arange(layout.dims // 2, dtype=torch.float64) / (layout.dims // 2))
    assert sorted(layout.order() or range(layout.head_dim)) == list(range(layout.head_dim))
    assert torch.equal(to_kernel(layout, query)[0], query[..., layout.order() or list(range(layout.head_dim))])
    string = longreach.methods.create("string", 24, shift=6, local_window=2)
    positions = torch.arange(12)[None]
    expected = reference.dense_attention(
        reference.unrotate(query, positions, inv_freq, layout=layout),
        reference.unrotate(key, positions, inv_freq, layout=layout),
        value,
        string.relative_positions(positions[:, :, None], positions[:, None, :]),
        inv_freq,
        0.25,
        layout=layout,
    )
    permuted_query, permuted_key = to_kernel(layout, query.float(), key.float())
    out = kernel.attention(permuted_query, permuted_key, value.float(), string.parts(), inv_freq.float(), scaling=0.25)
    assert (out.double() - expected).abs().max() <= 1e-5


@torch.no_grad()
def test_a_model_without_rope_in_any_layer_stays_stock_under_every_method():
    """SmolLM3 with every layer NoPE: no method changes its logits (the review found STRING did)."""
    model = tiny_model_of(transformers.SmolLM3Config, no_rope_layers=[0, 0], head_dim=16)
    ids = torch.randint(3, 97, (1, 60), generator=torch.Generator().manual_seed(0))
    stock = model(ids).logits
    assert all(not layout.rotated for layout in read_layouts(model).values())
    for method, params in [("string", STRING), ("rerope", {"window": 30}), ("dca", {"chunk_size": 30})]:
        longreach.apply(model, method, **params)
        assert torch.allclose(model(ids).logits, stock, atol=1e-5), method
    longreach.apply(model, "dynamic_drop", chunk=8, initial_rate=0.3, layers=(0, 1))
    assert torch.allclose(model(ids).logits, stock, atol=1e-5)


def tiny_model_of(config_class, **settings):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(
        config_class(**{**COMMON, **settings}), attn_implementation="sdpa"
    ).eval()


def _interleaved(q, k, cos, sin, unsqueeze_dim=1):
    """RoFormer's pairs ``(x_2k, x_2k+1)`` turned by transformers' cos and sin (each frequency twice, in halves)."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]

    def turn(x):
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)

    return turn(q), turn(k)


@torch.no_grad()
def test_the_self_check_refuses_a_model_whose_rotation_departs_from_its_family(monkeypatch):
    """A Llama config (verified: half pairs) whose attention turns interleaved pairs is refused in one line, with
    what it does, before anything changes; the same model with its family's own code is applied."""
    model = tiny_model("llama")
    longreach.apply(model, "string", **STRING)
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", _interleaved)
    with pytest.raises(ValueError) as refused:
        longreach.apply(model, "rerope", window=30)
    message = str(refused.value)
    assert message.startswith("llama: the self-check refuses layer 0: its own rotary code departs from the layout")
    assert "it behaves as RoPE, interleaved pairs, dims 0-15 of 16" in message and "\n" not in message
    assert longreach.describe(model).startswith("string(")  # the method applied before stays


@torch.no_grad()
def test_the_self_check_refuses_what_attention_is_handed_beyond_queries_and_keys():
    model = tiny_model("llama")
    recorded = {}
    with self_check._recording(recorded):
        self_check._record(model.model.layers[0].self_attn, *(torch.zeros(1, 2, 1, 4),) * 3, None, s_aux=torch.ones(2))
    assert recorded[0][2] == ["s_aux"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@torch.no_grad()
def test_the_self_check_spares_a_long_windows_rounding_and_catches_a_frequency_one_percent_off(dtype):
    """A 32K-window model with base 1e6 (Qwen2.5's) in each dtype passes: transformers' float32 angles are off by
    up to a few units in their last place at each position. The same model whose rotary module reports frequencies 1%
    off its own fails."""
    model = tiny_model_of(
        transformers.Qwen2Config,
        hidden_size=256,
        max_position_embeddings=32768,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    ).to(dtype)
    layouts = read_layouts(model)
    rotary = model.model.rotary_emb
    with pytest.raises(ValueError, match="the self-check refuses layer 0"):
        self_check.check(model, layouts, lambda layout: rotary.inv_freq * 1.01, "qwen2", 32768)


def test_the_vllm_plugin_takes_every_verified_layout_and_refuses_the_rest_in_one_line():
    """Interleaved pairs (GLM-4) and layers without RoPE (SmolLM3) run in vLLM (tests/test_vllm.py runs them); a
    refused or unclassified family is refused there as in transformers."""
    assert vllm.model_problem(transformers.Glm4Config()) is None
    assert vllm.model_problem(transformers.SmolLM3Config()) is None
    assert vllm.model_problem(transformers.Qwen3Config()) is None
    assert vllm.model_problem(transformers.Gemma2Config()).startswith("gemma2: its attention caps its logits")
    unknown = transformers.Qwen3Config()
    unknown.model_type = "qwen9"
    assert vllm.model_problem(unknown).startswith("qwen9 is not a family longreach has verified")


def test_inspect_reads_a_config_and_says_what_each_method_would_do():
    text = longreach.inspect(transformers.Cohere2Config(num_hidden_layers=4))
    lines = text.splitlines()
    assert lines[0] == "cohere2: 4 layers, L = 8192; verified (interleaved pairs, first dims)"
    assert "  layers 3 (1): full attention; no RoPE: stock under every method" in lines
    assert any(
        line.startswith("  layers 0-2 (3): sliding attention (window 4096); RoPE, interleaved") for line in lines
    )
    assert "  string        exact: string(shift=2731, local_window=128, mscale=False) [L=8192]" in lines
    refused = longreach.inspect(transformers.Gemma2Config(num_hidden_layers=2))
    assert refused.splitlines()[0].startswith("gemma2: 2 layers, L = 8192; refused: gemma2: its attention caps")
    assert "methods:" not in refused


@pytest.mark.slow
@pytest.mark.parametrize("family", ["glm4", "smollm3", "deepseek_v3"])
@torch.no_grad()
def test_every_layout_compiles_its_decoding_steps_whole(family):
    """Interleaved pairs over the first half of each head, layers without RoPE, the last dimensions rotated: each
    decoding step compiled with ``fullgraph=True`` through ``generate`` (the recipe CUDA graphs need) gives the
    tokens of eager generation."""
    torch._dynamo.reset()
    model = tiny_registry_model(family)
    longreach.apply(model, "string", **STRING)
    ids = torch.randint(3, 97, (2, 40), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    settings = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, cache_implementation="static")
    eager = model.generate(ids, **settings)
    config = transformers.CompileConfig(fullgraph=True, backend="eager")
    config._compile_all_devices = True  # transformers compiles on accelerators only, unless told
    assert torch.equal(model.generate(ids, compile_config=config, **settings), eager)


@torch.no_grad()
def test_a_multimodal_model_is_read_from_its_language_model_not_its_vision_tower():
    """Gemma 4 with its vision tower, whose attention layers carry layer indices and whose rotary module comes first:
    the layouts, the frequencies and the self-check are the language model's."""
    config = tiny_config("gemma4")
    config.vision_config = transformers.models.gemma4.configuration_gemma4.Gemma4VisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2
    )
    torch.manual_seed(0)
    model = transformers.Gemma4ForConditionalGeneration(config).eval()
    assert type(find_rotary(model)).__name__ == "Gemma4TextRotaryEmbedding"
    assert sorted(read_layouts(model)) == list(range(config.text_config.num_hidden_layers))
    longreach.apply(model, "string", **STRING)
    assert model(torch.randint(3, 90, (1, 40))).logits.isfinite().all()

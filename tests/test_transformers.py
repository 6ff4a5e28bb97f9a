"""longreach.apply on tiny models of several families, against stock SDPA and the dense reference."""

import copy
import re

import numpy as np
import pytest
import torch
import transformers
from helpers.tiny_models import model_from_config, tiny_config, tiny_model
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

import longreach
from longreach.integrations.transformers import key_positions_mask

STRING = dict(shift=20, local_window=4)  # tiny models: L = 96, so S = 20 < n = 80 exercises both parts


def ids(n, seed=0, batch=1):
    return torch.randint(3, 97, (batch, n), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_rope_through_longreach_equals_stock_sdpa(family):
    model, x = tiny_model(family), ids(80)
    stock = model(x).logits
    longreach.apply(model, "rope")
    assert torch.allclose(model(x).logits, stock, atol=1e-5)


@torch.no_grad()
def test_string_equals_the_dense_reference(family):
    model, x = tiny_model(family), ids(80)
    longreach.apply(model, "string", **STRING)
    kernel = model(x).logits.double()
    model.double()
    longreach.apply(model, "string", backend="reference", **STRING)
    reference = model(x, position_ids=torch.arange(80)[None]).logits
    assert (kernel - reference).abs().max() <= 1e-4
    assert (kernel - reference).abs().max() < 1e-2 * (kernel - tiny_model(family)(x).logits.double()).abs().max()


@torch.no_grad()
def test_generation_with_the_cache_equals_full_recomputation(family):
    model, x = tiny_model(family), ids(60, seed=1)
    longreach.apply(model, "string", **STRING)
    generated = model.generate(x, max_new_tokens=10, min_new_tokens=10, do_sample=False)
    sequence = x
    for _ in range(10):
        logits = model(sequence, use_cache=False).logits[:, -1]
        logits[:, model.config.eos_token_id] = float("-inf")  # as min_new_tokens does
        next_token = logits.argmax(-1, keepdim=True)
        sequence = torch.cat([sequence, next_token], dim=1)
    assert torch.equal(generated, sequence)


@torch.no_grad()
def test_a_left_padded_batch_equals_each_sequence_alone(family):
    model = tiny_model(family)
    longreach.apply(model, "string", **STRING)
    long, short = ids(50, seed=2), ids(35, seed=3)
    batch = torch.cat([long, torch.cat([torch.zeros(1, 15, dtype=torch.long), short], dim=1)])
    mask = (batch != 0).long()
    mask[0] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(batch, attention_mask=mask, position_ids=positions).logits
    assert (logits[0] - model(long).logits[0]).abs().max() <= 1e-5
    assert (logits[1, 15:] - model(short).logits[0]).abs().max() <= 1e-5
    generated = model.generate(batch, attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert torch.equal(
        generated[0, 50:], model.generate(long, max_new_tokens=6, min_new_tokens=6, do_sample=False)[0, 50:]
    )
    assert torch.equal(
        generated[1, 50:], model.generate(short, max_new_tokens=6, min_new_tokens=6, do_sample=False)[0, 35:]
    )


@torch.no_grad()
def test_remove_restores_and_apply_twice_replaces(family):
    model, x = tiny_model(family), ids(80)
    stock, implementation = model(x).logits, model.config._attn_implementation
    longreach.apply(model, "string", shift=10, local_window=2)
    longreach.apply(model, "string", **STRING)
    assert longreach.applied(model).shift == 20
    once = tiny_model(family)
    longreach.apply(once, "string", **STRING)
    assert torch.equal(model(x).logits, once(x).logits)
    longreach.remove(model)
    assert model.config._attn_implementation == implementation and longreach.applied(model) is None
    assert torch.equal(model(x).logits, stock)


def test_string_defaults_come_from_the_training_window():
    model = tiny_model("llama", max_position_embeddings=600)
    assert longreach.apply(model, "string") is model
    assert (longreach.applied(model).shift, longreach.applied(model).local_window) == (
        200,
        37,
    )  # W = L // 16 below L = 2048
    assert longreach.describe(model) == "string(shift=200, local_window=37, mscale=False) [L=600]"


def test_the_training_window_is_max_position_embeddings_not_the_original_one():
    """Llama 3.1: trained to 131072 after an 8192 stage; the STRING paper uses L = 128K, S = L/3."""
    llama31 = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_theta": 500000.0,
    }
    model = tiny_model("llama", max_position_embeddings=131072, rope_parameters=llama31)
    assert longreach.training_window(model.config) == 131072
    longreach.apply(model, "string")
    assert longreach.applied(model).shift == 43691
    longreach.apply(model, "string", shift=40_000)  # the Python API guide's line
    assert longreach.applied(model).shift == 40_000


def test_training_window_can_be_overridden():
    model = tiny_model("llama")
    longreach.apply(model, "string", training_window=60, local_window=4)
    assert (longreach.applied(model).shift, longreach.applied(model).training_window) == (20, 60)
    assert longreach.describe(model).endswith("[L=60]")
    longreach.apply(model, "dca", training_window=np.int64(80))
    assert longreach.applied(model).chunk_size == 60
    longreach.apply(model, "string", local_window=4)  # no override: the model's own L, not the last one given
    assert longreach.applied(model).training_window == 96
    with pytest.raises(ValueError, match="training_window=1 is out of range"):
        longreach.apply(model, "string", training_window=1, local_window=4)
    with pytest.raises(ValueError, match="training_window must be an integer"):
        longreach.apply(model, "string", training_window=60.5, local_window=4)


def test_string_defaults_fit_a_small_model():
    """The default W scales below L = 2048 (it was 128 at every L: out of range for this L = 96 model)."""
    assert (
        longreach.describe(longreach.apply(tiny_model("llama"), "string"))
        == "string(shift=32, local_window=6, mscale=False) [L=96]"
    )


def test_bad_parameters_and_methods_are_clear_errors():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="shift=96 is out of range: local_window < shift < L = 96"):
        longreach.apply(model, "string", shift=96, local_window=4)
    with pytest.raises(ValueError, match="unknown method .ntk-by-parts.; methods: rope, string, rerope"):
        longreach.apply(model, "ntk-by-parts")
    with pytest.raises(ValueError, match="backend='flash' is not one of"):
        longreach.apply(model, "rope", backend="flash")
    assert longreach.applied(model) is None


def test_a_model_without_rope_is_refused():
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50)
    with pytest.raises(ValueError, match="GPT2LMHeadModel has no rotary position embedding.*families"):
        longreach.apply(transformers.GPT2LMHeadModel(config), "string")


def test_mask_function_passes_key_positions_only():
    assert key_positions_mask(2, 4, 4, attention_mask=torch.ones(2, 4, dtype=torch.bool)) is None
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]]).bool()
    assert key_positions_mask(2, 4, 4, attention_mask=mask)[:, 0, 0].tolist() == [[0, 1, 2, 3], [-1, -1, 0, 1]]
    # decoding: the 2D mask is one token short of the cache, as transformers pads it
    assert key_positions_mask(2, 1, 5, q_offset=4, attention_mask=mask)[:, 0, 0].tolist() == [
        [0, 1, 2, 3, 4],
        [-1, -1, 0, 1, 2],
    ]
    # a static cache: 8 slots, 3 cached tokens and one query; the 4 empty slots are -2 (no keys; padding is -1)
    assert key_positions_mask(1, 1, 8, q_offset=torch.tensor(3))[0, 0, 0].tolist() == [0, 1, 2, 3, -2, -2, -2, -2]


def test_custom_dense_masks_are_refused_clearly():
    model = tiny_model("llama")
    longreach.apply(model, "rope")
    x = ids(6)
    custom = torch.ones(1, 1, 6, 6, dtype=torch.bool).tril()
    with pytest.raises(ValueError, match=r"custom attention mask of shape \(1, 1, 6, 6\)"):
        model(x, attention_mask=custom)


BASELINES = {
    "rerope": dict(window=30),
    "self_extend": dict(group_size=3, neighbor_window=16),
    "dca": dict(chunk_size=30, local_window=6),
    "string+yarn": dict(shift=20, local_window=4, scaling={"rope_type": "yarn", "factor": 2.0}),
    "dpe": dict(group_scales=(2, 3, 1, 4), local_window=12, top_k=None),  # per-head pairs: tests/test_dpe.py
}


def apply_named(model, label, **extra):
    return longreach.apply(model, label.split("+")[0], **BASELINES[label], **extra)


@pytest.mark.parametrize("label", sorted(BASELINES))
@torch.no_grad()
def test_baselines_equal_the_dense_reference(family, label):
    model, x = tiny_model(family), ids(80)
    apply_named(model, label)
    kernel = model(x).logits.double()
    model.double()
    apply_named(model, label, backend="reference")
    reference = model(x, position_ids=torch.arange(80)[None]).logits
    assert (kernel - reference).abs().max() <= 1e-4


@pytest.mark.parametrize("family", ["qwen2", "gemma3", "phi3"])
@pytest.mark.parametrize("label", sorted(BASELINES))
@torch.no_grad()
def test_baselines_generate_and_batch_like_single_sequences(label, family):
    """Self-Extend and DCA depend on absolute positions: left padding must not shift them."""
    model = tiny_model(family)
    apply_named(model, label)
    long, short = ids(70, seed=4), ids(41, seed=5)
    batch = torch.cat([long, torch.cat([torch.zeros(1, 29, dtype=torch.long), short], dim=1)])
    mask = torch.ones_like(batch)
    mask[1, :29] = 0
    logits = model(batch, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    assert (logits[0] - model(long).logits[0]).abs().max() <= 1e-5
    assert (logits[1, 29:] - model(short).logits[0]).abs().max() <= 1e-5
    generated = model.generate(batch, attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    alone = [model.generate(x, max_new_tokens=6, min_new_tokens=6, do_sample=False) for x in (long, short)]
    assert torch.equal(generated[0, 70:], alone[0][0, 70:]) and torch.equal(generated[1, 70:], alone[1][0, 41:])
    sequence = long
    for _ in range(6):
        logits = model(sequence, use_cache=False).logits[:, -1]
        logits[:, model.config.eos_token_id] = float("-inf")
        sequence = torch.cat([sequence, logits.argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(alone[0], sequence)


@pytest.mark.parametrize(
    "name, params",
    [
        ("pi", {"factor": 2.0}),
        ("ntk", {"factor": 2.0}),
        ("dynamic", {"factor": 2.0}),
        ("yarn", {"factor": 2.0, "beta_fast": 16.0}),
        ("llama3", {"factor": 4.0}),
    ],
)
@pytest.mark.parametrize("family", ["llama", "qwen2"])
@torch.no_grad()
def test_frequency_methods_equal_transformers_own_scaling(name, params, family):
    model, x = tiny_model(family), ids(200)  # beyond the window of 96: dynamic NTK kicks in
    stock = model(x).logits
    longreach.apply(model, name, **params)
    rope_parameters = copy.deepcopy(model.config.rope_parameters)
    assert rope_parameters["rope_type"] == {"pi": "linear", "ntk": "default"}.get(name, name)
    ours = model(x).logits
    scaled = tiny_model(family, rope_parameters=rope_parameters)  # transformers' own initialiser, same weights
    assert torch.allclose(ours, scaled(x).logits, atol=1e-5)
    assert not torch.allclose(ours, stock, atol=1e-3)
    assert "+" in longreach.describe(model) and name in longreach.describe(model)
    longreach.remove(model)
    assert model.config.rope_parameters["rope_type"] == "default"
    assert torch.equal(model(x).logits, stock)


def test_ntk_scales_the_base_by_factor_to_the_d_over_d_minus_2():
    model = tiny_model("llama")  # head dim 16
    longreach.apply(model, "ntk", factor=4.0)
    assert model.config.rope_parameters["rope_theta"] == pytest.approx(10000.0 * 4.0 ** (16 / 14))


def test_frequency_method_errors():
    with pytest.raises(ValueError, match="factor=0.5 is out of range: a number >= 1"):
        longreach.apply(tiny_model("llama"), "yarn", factor=0.5)
    with pytest.raises(ValueError, match="pi has no parameter beta_fast"):
        longreach.apply(tiny_model("llama"), "pi", beta_fast=3)
    with pytest.raises(ValueError, match="unknown frequency method 'ntk-by-parts'"):
        longreach.apply(tiny_model("llama"), "rope", scaling={"rope_type": "ntk-by-parts"})


@pytest.mark.parametrize("name, params", [("yarn", {"factor": 2.0}), ("ntk", {"factor": 3.0}), ("pi", {"factor": 2.0})])
@torch.no_grad()
def test_a_frequency_method_rescales_gemma3s_full_attention_layers_only(name, params):
    model, x = tiny_model("gemma3"), ids(150)
    stock = model(x).logits
    own = copy.deepcopy(model.config.rope_parameters)
    longreach.apply(model, name, **params)
    rope_parameters = copy.deepcopy(model.config.rope_parameters)
    assert rope_parameters["sliding_attention"] == own["sliding_attention"]
    assert rope_parameters["full_attention"]["rope_type"] == {"pi": "linear", "ntk": "default"}.get(name, name)
    ours = model(x).logits
    # transformers' own model with those parameters, set after the config is built: 5.4's validation of a yarn per layer
    # type looks for original_max_position_embeddings at the top level and raises a KeyError
    config = tiny_config("gemma3")
    config.rope_parameters = rope_parameters
    assert torch.allclose(ours, model_from_config(config)(x).logits, atol=1e-5)
    assert not torch.allclose(ours, stock, atol=1e-3)
    longreach.remove(model)
    assert model.config.rope_parameters == own and torch.equal(model(x).logits, stock)


def test_a_frequency_method_composes_over_gemma3s_own_linear_scaling_per_layer_type():
    own = {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    }
    model = tiny_model("gemma3", rope_parameters=copy.deepcopy(own))
    rotary = model.model.rotary_emb
    full, sliding = rotary.full_attention_inv_freq.clone(), rotary.sliding_attention_inv_freq.clone()
    longreach.apply(model, "ntk", factor=2.0)
    rotary = model.model.rotary_emb
    assert model.config.rope_parameters == own  # composed: the model's own parameters stay
    assert torch.allclose(rotary.full_attention_inv_freq, full * 2.0 ** (-torch.arange(8) / 7), rtol=1e-6)
    assert torch.equal(rotary.sliding_attention_inv_freq, sliding)


def test_reapplying_keeps_the_models_own_window_after_a_rescale():
    model = tiny_model("llama")
    longreach.apply(model, "yarn", factor=1.5, original_max_position_embeddings=64)  # the paper's protocol shape
    longreach.apply(model, "string", shift=20, local_window=4)
    assert longreach.applied(model).training_window == 96
    assert model.config.rope_parameters["rope_type"] == "default"


LLAMA31 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_theta": 500000.0,
}
QWEN_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "rope_theta": 1e6}
OWN_SCALINGS = {"llama3.1": ("llama", LLAMA31), "qwen+yarn": ("qwen2", QWEN_YARN)}


@pytest.mark.parametrize("own", sorted(OWN_SCALINGS))
@torch.no_grad()
def test_a_frequency_method_composes_over_the_models_own_scaling(own, tmp_path):
    """Llama 3.1 (llama3) and Qwen (yarn) keep their scaling: a frequency method maps their frequencies further."""
    family, parameters = OWN_SCALINGS[own]
    model, x = tiny_model(family, max_position_embeddings=131072, rope_parameters=parameters), ids(80)
    stock, own_freq = model(x).logits, model.model.rotary_emb.inv_freq.clone()
    own_scaling = model.model.rotary_emb.attention_scaling
    longreach.apply(model, "yarn", factor=1.0)  # the identity: nothing moves
    assert torch.equal(model.model.rotary_emb.inv_freq, own_freq)
    assert torch.allclose(
        model(x).logits, stock, rtol=0, atol=1e-6
    )  # the same frequencies (a rebuilt module may round cos/sin apart: PyTorch 2.7)
    longreach.apply(model, "dca", chunk_size=30, local_window=6, scaling={"rope_type": "yarn", "factor": 2.0})
    freq = model.model.rotary_emb.inv_freq
    assert freq[0] == own_freq[0] and freq[-1] == pytest.approx(own_freq[-1].item() / 2)  # the lowest one halves
    assert model.model.rotary_emb.attention_scaling == pytest.approx(own_scaling * (0.1 * np.log(2) + 1))
    assert model.config.rope_parameters == parameters  # transformers' own description stays the model's
    longreach.apply(model, "pi", factor=4.0)
    assert torch.allclose(model.model.rotary_emb.inv_freq, own_freq / 4)
    longreach.apply(model, "ntk", factor=4.0)
    pairs = torch.arange(own_freq.shape[0])
    assert torch.allclose(model.model.rotary_emb.inv_freq, own_freq * 4.0 ** (-2 * pairs / (2 * len(own_freq) - 2)))
    want = model(x).logits
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    longreach.integrations.transformers.reapply(loaded, loaded.config.longreach)
    assert torch.allclose(loaded(x).logits, want, atol=1e-5)
    longreach.remove(model)
    assert torch.equal(model.model.rotary_emb.inv_freq, own_freq)
    assert torch.allclose(
        model(x).logits, stock, rtol=0, atol=1e-6
    )  # the same frequencies (a rebuilt module may round cos/sin apart: PyTorch 2.7)


@pytest.mark.parametrize(
    "name, params, transformers_parameters",
    [
        ("pi", {"factor": 3.0}, {"rope_type": "linear", "factor": 3.0}),
        ("ntk", {"factor": 3.0}, {"rope_type": "default", "rope_theta": 10000.0 * 3.0 ** (16 / 14)}),
        (
            "yarn",
            {"factor": 3.0, "original_max_position_embeddings": 8192},
            {"rope_type": "yarn", "factor": 3.0, "original_max_position_embeddings": 8192, "truncate": False},
        ),
    ],
)
def test_the_composed_maps_equal_transformers_on_default_frequencies(name, params, transformers_parameters):
    default = tiny_model("llama").model.rotary_emb
    scaled = tiny_model("llama", rope_parameters={"rope_theta": 10000.0, **transformers_parameters}).model.rotary_emb
    inv_freq, attention_scaling = longreach.methods.create(name, 96, **params).over(
        default.inv_freq, 1.0, {"rope_type": "llama3"}
    )
    assert torch.allclose(inv_freq, scaled.inv_freq, rtol=1e-6)
    assert attention_scaling == pytest.approx(scaled.attention_scaling)


def test_what_does_not_compose_is_refused_in_one_line_naming_the_models_scaling():
    model = tiny_model("llama", max_position_embeddings=131072, rope_parameters=LLAMA31)
    with pytest.raises(
        ValueError, match=r"^llama3 over the model's own rope_type='llama3' \(factor=8.0, .*\) scaling is not defined"
    ):
        longreach.apply(model, "llama3", factor=2.0)
    with pytest.raises(ValueError, match="dynamic over the model's own rope_type='llama3'"):
        longreach.apply(model, "rope", scaling={"rope_type": "dynamic"})
    dynamic = tiny_model("llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    with pytest.raises(ValueError, match="own rope_type='dynamic' .* change during the forward pass"):
        longreach.apply(dynamic, "yarn")
    longreach.apply(dynamic, "string", shift=20, local_window=4)  # a position method alone is fine


@torch.no_grad()
def test_a_refused_apply_leaves_the_method_already_applied():
    """Everything is validated before the model changes (the review found a refusal leaving plain rope)."""
    gemma = tiny_model("gemma3")
    longreach.apply(gemma, "string", shift=20, local_window=4)
    with pytest.raises(ValueError, match=re.escape("factor=1e+308 is out of range")):
        longreach.apply(gemma, "dca", scaling={"rope_type": "yarn", "factor": 1e308})
    assert longreach.describe(gemma).startswith("string(shift=20")
    llama, x = tiny_model("llama"), ids(80)
    longreach.apply(
        llama, "self_extend", group_size=3, neighbor_window=16, scaling={"rope_type": "yarn", "factor": 2.0}
    )
    want, described = llama(x).logits, longreach.describe(llama)
    for name in ("ntk", "pi", "yarn"):
        with pytest.raises(ValueError, match=re.escape("factor=1e+308 is out of range")):
            longreach.apply(llama, name, factor=1e308)
    assert longreach.describe(llama) == described and torch.equal(llama(x).logits, want)


@pytest.mark.parametrize("name", ["yarn", "llama3"])
@torch.no_grad()
def test_the_original_window_given_is_the_one_computed_also_on_phi3(name):
    """Phi-3 keeps original_max_position_embeddings outside rope_parameters, where transformers lets it win: the
    value a user gives must be the one the frequencies are computed with, as describe() and the record say."""
    model = tiny_model("phi3")
    longreach.apply(model, name, factor=4.0, original_max_position_embeddings=24)
    assert "original_max_position_embeddings=24" in longreach.describe(model)
    assert model.config.longreach["scaling"]["original_max_position_embeddings"] == 24
    parameters = {"factor": 4.0, "original_max_position_embeddings": 24, "rope_theta": 10000.0, "rope_type": name}
    if name == "llama3":
        parameters |= {"low_freq_factor": 1.0, "high_freq_factor": 4.0}
    config = transformers.LlamaConfig(  # Phi-3's head: 16 dims, half of them rotary
        hidden_size=64, num_attention_heads=4, rope_parameters={**parameters, "partial_rotary_factor": 0.5}
    )
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[name](config, None)
    applied = model.model.rotary_emb
    assert torch.allclose(applied.inv_freq, inv_freq) and applied.attention_scaling == pytest.approx(attention_scaling)
    assert not torch.allclose(applied.inv_freq, tiny_model("phi3").model.rotary_emb.inv_freq)

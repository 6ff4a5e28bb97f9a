"""The caches and calls people use: static and sliding caches, compile, padding without position_ids,
copies, the registries, meta tensors, softcapping, output_attentions, save/load, DCA's temperature."""

import copy
import gc
import math

import numpy as np
import pytest
import torch
import transformers
from helpers.model_cases import CACHE_FAMILIES, METHODS, ids, left_padded
from helpers.native import native_builds
from helpers.tiny_models import COMMON, tiny_model
from transformers import AttentionInterface, StaticCache
from transformers.masking_utils import AttentionMaskInterface

import longreach


@pytest.mark.parametrize(
    "family", [f if f == "llama" else pytest.param(f, marks=pytest.mark.slow) for f in sorted(CACHE_FAMILIES)]
)
@pytest.mark.parametrize("name", sorted(METHODS))
@torch.no_grad()
def test_a_static_cache_equals_the_dynamic_cache(family, name):
    """transformers hands a static cache over whole (max_cache_len keys, most of them empty slots)."""
    model = tiny_model(family, **CACHE_FAMILIES[family])
    longreach.apply(model, name, **METHODS[name])
    x, mask = left_padded()
    settings = dict(attention_mask=mask, max_new_tokens=12, min_new_tokens=12, do_sample=False)
    assert torch.equal(model.generate(x, cache_implementation="static", **settings), model.generate(x, **settings))
    cache = StaticCache(config=model.config, max_cache_len=64)  # a chunked prefill into a static cache
    first = model(x[:, :25], attention_mask=mask[:, :25], past_key_values=cache, use_cache=True).logits
    second = model(x[:, 25:], attention_mask=mask, past_key_values=cache, use_cache=True).logits
    whole = model(x, attention_mask=mask).logits
    assert (torch.cat([first, second], 1) - whole)[mask.bool()].abs().max() <= 1e-5


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("name", sorted(METHODS))
@pytest.mark.parametrize("backend", ["auto", pytest.param("flex", marks=pytest.mark.slow)])
@torch.no_grad()
def test_cached_decoding_equals_the_reference_in_models(family, name, backend):
    """Left padding, a chunked prefill into the cache, then one-token steps, with FlexAttention (eager on
    CPU) too. Gemma 3's sliding cache drops the padding after 24 tokens: absolute positions must still
    count real tokens (they came from position_ids, wrong without them, until this test)."""
    model = tiny_model(family, dtype=torch.float64, **CACHE_FAMILIES[family])
    x, mask = left_padded(n=34)
    longreach.apply(model, name, backend="reference", **METHODS[name])
    want = model(x, attention_mask=mask).logits
    longreach.apply(model, name, backend=backend, **METHODS[name])
    cache = transformers.DynamicCache(config=model.config)
    pieces = [model(x[:, :30], attention_mask=mask[:, :30], past_key_values=cache).logits]
    for end in range(31, 35):
        pieces.append(model(x[:, end - 1 : end], attention_mask=mask[:, :end], past_key_values=cache).logits)
    assert (torch.cat(pieces, 1) - want)[mask.bool()].abs().max() <= 1e-8


@pytest.mark.parametrize("family", ["llama", pytest.param("gemma3", marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", ["rope", *sorted(METHODS)])
@torch.no_grad()
def test_generate_with_a_chunked_prefill_equals_one_forward(family, name):
    """transformers' ``prefill_chunk_size`` (the runner's --prefill-tokens): a left-padded batch read in
    chunks of 11 tokens (the padding inside the first; Gemma 3's sliding cache dropping keys between
    chunks) scores every step as one forward does."""
    model = tiny_model(family, dtype=torch.float64, **CACHE_FAMILIES[family])
    if name != "rope":
        longreach.apply(model, name, **METHODS[name])
    x, mask = left_padded(n=40, pad=7)
    settings = dict(
        attention_mask=mask,
        max_new_tokens=6,
        min_new_tokens=6,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    whole, chunked = model.generate(x, **settings), model.generate(x, prefill_chunk_size=11, **settings)
    assert torch.equal(chunked.sequences, whole.sequences)
    assert (torch.stack(chunked.logits) - torch.stack(whole.logits)).abs().max() <= 1e-8


@pytest.mark.slow
@torch.no_grad()
def test_compiled_forward_with_a_static_cache_equals_eager():
    model = tiny_model("llama")
    longreach.apply(model, "string", **METHODS["string"])
    x = ids(40, batch=1)
    eager = model.generate(x, max_new_tokens=4, do_sample=False)
    model.forward = torch.compile(model.forward, backend="eager")
    assert torch.equal(model.generate(x, max_new_tokens=4, do_sample=False, cache_implementation="static"), eager)


@pytest.mark.parametrize("name", ["self_extend", "dca", "dynamic_drop"])
@torch.no_grad()
def test_left_padding_without_position_ids_does_not_move_absolute_positions(name):
    """The usual scoring call model(ids, attention_mask=m): keys' positions come from the mask."""
    model = tiny_model("llama")
    longreach.apply(model, name, **METHODS[name])
    x = ids(50, batch=1)
    for pad in (3, 17):
        padded = torch.cat([torch.zeros(1, pad, dtype=torch.long), x], 1)
        mask = (torch.arange(pad + 50) >= pad).long()[None]
        assert (model(padded, attention_mask=mask).logits[0, pad:] - model(x).logits[0]).abs().max() <= 1e-5


@torch.no_grad()
def test_a_deep_copy_is_applied_like_its_original_and_removed_on_its_own():
    x = ids(80, batch=1)
    for name, params in (("string", METHODS["string"]), ("yarn", {"factor": 2.0})):
        model = tiny_model("llama")
        longreach.apply(model, name, **params)
        want = model(x).logits
        twin = copy.deepcopy(model)
        assert longreach.describe(twin) == longreach.describe(model) != "rope"
        longreach.remove(model)
        assert torch.equal(twin(x).logits, want)
        assert longreach.describe(model) == "rope" and longreach.describe(twin) != "rope"
        longreach.remove(twin)
        assert torch.equal(twin(x).logits, model(x).logits)


def test_applied_models_do_not_grow_the_registries():
    longreach.apply(
        tiny_model("llama"), "string", shift=9, local_window=4
    )  # the first use registers longreach's attention, once
    gc.collect()
    before = len(AttentionInterface._global_mapping), len(AttentionMaskInterface._global_mapping)
    for i in range(20):
        longreach.apply(tiny_model("llama"), "string", shift=10 + i, local_window=4)
    gc.collect()
    assert (len(AttentionInterface._global_mapping), len(AttentionMaskInterface._global_mapping)) == before


@torch.no_grad()
def test_meta_tensors_work_as_with_stock_attention():
    model = tiny_model("llama")
    longreach.apply(model, "string", **METHODS["string"])
    model.to("meta")
    assert model(ids(30).to("meta")).logits.shape == (2, 30, 97)


def test_gemma2_softcapping_is_refused_at_apply():
    config = transformers.Gemma2Config(**COMMON, head_dim=16)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match=r"^gemma2: its attention caps its logits \(attn_logit_softcapping\)"):
        longreach.apply(model, "string", shift=20, local_window=4)
    assert longreach.applied(model) is None


@torch.no_grad()
def test_output_attentions_warns_instead_of_returning_nothing_silently():
    model = tiny_model("llama")
    longreach.apply(model, "string", **METHODS["string"])
    import longreach.integrations.attention as integration

    integration._warned_attentions = False
    with pytest.warns(UserWarning, match="does not return attention weights"):
        model(ids(30), output_attentions=True)


@torch.no_grad()
def test_packed_sequences_are_refused_not_mixed():
    model = tiny_model("llama")
    longreach.apply(model, "string", **METHODS["string"])
    packed = torch.cat([torch.arange(20), torch.arange(20)])[None]
    with pytest.raises(ValueError, match="packed sequences"):
        model(ids(40, batch=1), position_ids=packed, use_cache=False)  # transformers detects packing without a cache
    torch._dynamo.reset()
    compiled = torch.compile(
        model, backend="eager"
    )  # compiled, transformers always adds the packing mask: still refused
    with pytest.raises(ValueError, match="packed sequences"):
        compiled(ids(40, batch=1), position_ids=packed, use_cache=False)


@pytest.mark.parametrize(
    "name, params",
    [
        ("string", {**METHODS["string"], "training_window": 90}),
        ("dca", {**METHODS["dca"], "mscale": True}),
        ("ntk", {"factor": 3.0}),
        (
            "self_extend",
            {
                **METHODS["self_extend"],
                "scaling": {"rope_type": "yarn", "factor": 2.0},
                "drop": {"method": "drop", "rate": 0.2, "layers": [1]},
            },
        ),
        ("dpe", METHODS["dpe"]),
    ],
)  # its dimensions tensor is saved in config.json
@torch.no_grad()
def test_save_pretrained_records_the_method_and_load_reapplies_it(tmp_path, name, params):
    model = tiny_model("llama")
    x = ids(80, batch=1)
    longreach.apply(model, name, **params)
    want, described = model(x).logits, longreach.describe(model)
    model.save_pretrained(tmp_path)
    _byte_tokenizer().save_pretrained(tmp_path)
    loaded, _ = longreach.load(str(tmp_path))
    assert longreach.describe(loaded) == described
    assert (loaded(x).logits - want).abs().max() <= 1e-5
    longreach.remove(loaded)
    assert torch.allclose(loaded(x).logits, tiny_model("llama")(x).logits, atol=1e-5)  # back to the stock model
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)  # without longreach: frequencies only
    assert longreach.describe(plain) == "rope"


@torch.no_grad()
def test_the_backend_is_a_device_choice_not_saved_with_the_model(tmp_path):
    """A model saved with a backend of one device loads on another: the record keeps the method only."""
    import json

    model, x = tiny_model("llama"), ids(40, batch=1)
    longreach.apply(model, "string", backend="math", **METHODS["string"])
    want = model(x).logits
    model.save_pretrained(tmp_path)
    _byte_tokenizer().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert "backend" not in config["longreach"]
    config["longreach"]["backend"] = "cuda_efficient"  # as versions before this one saved it
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded, _ = longreach.load(str(tmp_path))  # on this CPU
    assert loaded._longreach.backend == "auto" and (loaded(x).logits - want).abs().max() <= 1e-5


def _byte_tokenizer():
    from helpers.tiny_models import byte_tokenizer

    return byte_tokenizer()


def test_dca_mscale_is_the_official_length_dependent_temperature():
    method = longreach.methods.create("dca", training_window=100, chunk_size=60, local_window=10, mscale=True)
    scale = method.logit_scale_at(torch.tensor([50, 100, 101, 400]))
    assert scale[:2].tolist() == [1.0, 1.0]
    assert scale[3].item() == pytest.approx((0.05 * math.log(4) + 1) ** 2)
    assert longreach.methods.create("dca", training_window=100).logit_scale_at(torch.tensor([400])) == 1.0


@torch.no_grad()
def test_dca_mscale_equals_the_reference_in_prefill_and_decoding():
    model = tiny_model("llama", dtype=torch.float64)
    x, mask = left_padded(n=130, pad=40)  # row 0 is beyond L = 96, row 1 (90 real tokens) inside it
    longreach.apply(model, "dca", mscale=True, **METHODS["dca"])
    kernel = model(x, attention_mask=mask).logits
    longreach.apply(model, "dca", mscale=True, backend="reference", **METHODS["dca"])
    reference = model(x, attention_mask=mask).logits
    assert (kernel - reference)[mask.bool()].abs().max() <= 1e-8
    steps = []
    for backend in ("auto", "reference"):  # decoding: n grows by one (cached states keep the temperature of their n)
        longreach.apply(model, "dca", mscale=True, backend=backend, **METHODS["dca"])
        prefix = model(x[:, :-1], attention_mask=mask[:, :-1], use_cache=True)
        steps.append(model(x[:, -1:], attention_mask=mask, past_key_values=prefix.past_key_values).logits)
    assert (steps[0] - steps[1]).abs().max() <= 1e-8
    longreach.apply(model, "dca", **METHODS["dca"])
    assert (model(x, attention_mask=mask).logits - kernel)[0].abs().max() > 1e-5  # it changes row 0 ...
    assert (model(x, attention_mask=mask).logits - kernel)[1][mask[1].bool()].abs().max() <= 1e-8  # ... not row 1


def test_numpy_integers_are_integers_and_the_cuda_backend_needs_cuda():
    model = tiny_model("llama")
    longreach.apply(model, "string", shift=np.int64(20), local_window=np.int32(4))
    assert longreach.applied(model).shift == 20 and type(longreach.applied(model).shift) is int
    with pytest.raises(
        ValueError, match="backend='cuda_efficient' needs a model on a CUDA device; this model is on 'cpu'"
    ):
        longreach.apply(model, "rope", backend="cuda_efficient")


@pytest.mark.parametrize(
    "name, params",
    [("dynamic_drop", dict(chunk=8, initial_rate=0.2, layers=(0, 1))), ("dca", {**METHODS["dca"], "mscale": True})],
)
@torch.no_grad()
def test_a_prompt_whose_last_token_is_read_alone_is_still_prompt_text(name, params):
    """Beyond L = 96, with prompts of 97 and 121 tokens read 12 at a time: the last chunk holds one token,
    which is the prompt's, not a generated one (DDA's rate), and DCA's temperature takes the whole prompt."""
    model = tiny_model("llama", dtype=torch.float64)
    longreach.apply(model, name, **params)
    x, mask = left_padded(n=121, pad=24)  # 121 = 10 x 12 + 1
    settings = dict(
        max_new_tokens=4, min_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True
    )
    for inputs in (dict(input_ids=x[:1]), dict(input_ids=x, attention_mask=mask)):
        whole, chunked = (
            model.generate(**inputs, **settings),
            model.generate(**inputs, prefill_chunk_size=12, **settings),
        )
        assert (torch.stack(chunked.logits) - torch.stack(whole.logits)).abs().max() <= 1e-8
        if name == "dca":  # its cached states keep the temperature of their own length: no one-forward equivalent
            continue
        sequence = inputs[
            "input_ids"
        ]  # read whole, step by step, with the prompt declared: generated tokens are generated
        for step in range(4):
            padding = torch.cat(
                [
                    inputs.get("attention_mask", torch.ones_like(x[:1])),
                    torch.ones(len(sequence), step, dtype=torch.long),
                ],
                1,
            )
            with longreach.integrations.recording.generation(padding[:, : inputs["input_ids"].shape[1]].sum(-1)):
                logits = model(sequence, attention_mask=padding).logits[:, -1]
            assert (logits - whole.logits[step]).abs().max() <= 1e-6  # generate returns float32 logits
            sequence = torch.cat([sequence, whole.sequences[:, sequence.shape[1] : sequence.shape[1] + 1]], 1)


@torch.no_grad()
def test_generate_declares_the_prompt_and_remove_gives_back_transformers_own():
    model = tiny_model("llama")

    def custom(*args, **kwargs):
        return "custom"  # transformers' custom_generate puts one on the instance

    model.generate = custom
    longreach.apply(model, "dynamic_drop", **METHODS["dynamic_drop"])
    assert model.generate(ids(10)) == "custom"
    longreach.remove(model)
    assert model.generate is custom
    del model.generate
    longreach.apply(model, "string", **METHODS["string"])
    twin = copy.deepcopy(model)
    assert twin.generate.args[0] is twin  # a deep copy generates with itself
    longreach.remove(model)
    assert "generate" not in model.__dict__ and "generate" in twin.__dict__


@pytest.mark.parametrize("backend", ["auto", "cpu_flash", pytest.param("flex", marks=pytest.mark.slow)])
@torch.no_grad()
def test_a_forward_builds_each_plan_once_whatever_the_number_of_layers(monkeypatch, backend):
    """Plans, block masks, the C++ kernel's layout, shift angles and the scan for padding depend on positions alone:
    the first layer of a forward pass builds them and every other layer reuses them. DCA (three parts, key spans, a
    per-token key shift) on a left-padded batch, prefill and a decoding step: the same builds for 2 layers as for 5."""
    from longreach.attention import kernel, shifts
    from longreach.attention.backends import cpu_fused, flex, tiled
    from longreach.attention.backends.flex import masks
    from longreach.integrations import attention as integration

    built = []
    for module, name in (
        (tiled, "blocks"),
        (tiled, "padded_keys"),
        (kernel, "fold_block_key_shifts"),
        (cpu_fused.Layout, "of"),
        (shifts.KEY_ROTATIONS, "get"),
        (integration, "keys_of"),
    ):
        real = getattr(module, name)
        monkeypatch.setattr(
            module, name, lambda *args, real=real, name=name, **kwargs: built.append(name) or real(*args, **kwargs)
        )
    real_mask, real_launch_mask = masks.Region.block_mask, flex.segmented_block_mask
    monkeypatch.setattr(
        masks.Region, "block_mask", lambda self, *args: built.append("block mask") or real_mask(self, *args)
    )
    monkeypatch.setattr(
        flex, "segmented_block_mask", lambda *args: built.append("one launch") or real_launch_mask(*args)
    )
    counts = {}
    for layers in (2, 5):
        model = tiny_model("llama", num_hidden_layers=layers)
        longreach.apply(model, "dca", backend=backend, **METHODS["dca"])
        x, mask = left_padded(n=70, pad=9)
        built.clear()
        prefix = model(x[:, :-1], attention_mask=mask[:, :-1], use_cache=True)
        prefill = sorted(built)
        built.clear()
        model(x[:, -1:], attention_mask=mask, past_key_values=prefix.past_key_values)
        counts[layers] = (prefill, sorted(built))
    assert counts[2] == counts[5]
    prefill, step = counts[2]
    if backend == "flex":  # prefill: every part in one launch, one block mask; a step: a block mask per folded part
        assert prefill.count("one launch") == 1 and "block mask" not in prefill and step.count("block mask") >= 3
    elif backend == "auto" and native_builds():  # the C++ kernel: one layout per forward pass
        assert prefill.count("of") == 1 and step.count("of") == 1 and "blocks" not in prefill + step
    else:
        assert prefill.count("blocks") == 3 and step.count("blocks") >= 3  # DCA's three parts
    assert prefill.count("get") == 1 and prefill.count("keys_of") == 1  # one key shift, one scan of the mask
    assert step.count("keys_of") == 1 and step.count("fold_block_key_shifts") == 1


COMPILED_STEP = [("llama", name, "auto") for name in ["rope", "pi", "ntk", "yarn", "drop", *sorted(METHODS)]] + [
    ("mistral", "string", "auto"),
    ("mistral", "dca", "auto"),
    ("gemma3", "self_extend", "auto"),
    ("gemma3", "dpe", "auto"),
    ("llama", "rerope", "math"),
    ("mistral", "dca", "math"),
]


@pytest.mark.slow
@pytest.mark.parametrize("family, name, backend", COMPILED_STEP)
@torch.no_grad()
def test_a_decoding_step_with_a_static_cache_compiles_whole(family, name, backend):
    """``torch.compile(fullgraph=True)`` of a decoding step against a ``StaticCache`` (left-padded batch, empty
    slots): no graph break -- no host sync, no data-dependent shape -- so CUDA graphs can capture it; the
    same logits as the eager step. Sliding-window and hybrid caches too. ``auto`` calls the fused Triton kernel as
    an operator where it can (here under Triton's interpreter; not Drop Attention, not DPE), ``math`` scores every
    slot with torch operations (:mod:`longreach.attention.compiled_step`)."""
    # each case compiles anew: a fresh model is a new guard on the same code, and PyTorch caps recompiles at 8
    torch._dynamo.reset()
    model = tiny_model(family, **CACHE_FAMILIES[family])
    params = (
        {"rate": 0.3, "layers": (0, 1)}
        if name == "drop"
        else {"factor": 2.0}
        if name in ("pi", "ntk", "yarn")
        else METHODS.get(name, {})
    )
    longreach.apply(model, name, backend=backend, **params)
    x, mask = left_padded(n=50, pad=7)
    caches = [StaticCache(config=model.config, max_cache_len=64) for _ in range(2)]
    for cache in caches:
        model(x[:, :-1], attention_mask=mask[:, :-1], past_key_values=cache, use_cache=True)
    position = (mask.long().cumsum(-1) - 1)[:, -1:]

    def step(token, mask, cache, position):
        return model(
            token,
            attention_mask=mask,
            past_key_values=cache,
            cache_position=torch.tensor([49]),
            position_ids=position,
            use_cache=True,
        ).logits

    eager = step(x[:, -1:], mask, caches[0], position)
    compiled = torch.compile(step, fullgraph=True, backend="eager")(x[:, -1:], mask, caches[1], position)
    assert (compiled - eager).abs().max() <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("name, padded", [("string", True), ("dca", True), ("string", False)])
@torch.no_grad()
def test_generate_compiles_its_decoding_steps_whole(name, padded):
    """The documented recipe (docs/integrations.md):
    ``generate(cache_implementation="static", compile_config=CompileConfig(fullgraph=True))``,
    transformers' own compilation of each decoding step (CUDA graphs on a GPU, ``mode="reduce-overhead"``; here
    the graph alone, on the CPU): no graph break, the tokens of eager generation, a left-padded batch or one prompt
    unpadded; the step compiled once (the last step, whose static cache is full, gets the same arguments)."""
    torch._dynamo.reset()
    model = tiny_model("llama")
    longreach.apply(model, name, **METHODS[name])
    x, mask = left_padded(n=40, pad=5) if padded else (ids(40, batch=1), torch.ones(1, 40, dtype=torch.long))
    settings = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, cache_implementation="static")
    eager = model.generate(x, **settings)
    config = transformers.CompileConfig(fullgraph=True, backend="eager")
    config._compile_all_devices = True  # transformers compiles on accelerators only, unless told
    torch._dynamo.utils.counters.clear()
    assert torch.equal(model.generate(x, compile_config=config, **settings), eager)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # the steps ran compiled, compiled once


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(METHODS))
@torch.no_grad()
def test_every_method_compiles_whole_on_a_partial_rotary_model(name):
    """Issue trust4, defect 4: Phi-3's ``partial_rotary_factor=0.5`` (half of each head rotates), each method's
    decoding step compiled with ``fullgraph=True`` through ``generate``: the tokens of eager generation. DCA's folded
    chunk queries widen the rotated halves, which the unrotated half must follow."""
    torch._dynamo.reset()
    model = tiny_model("phi3")
    params = dict(METHODS[name], dimensions=torch.rand(2, 4, 4, generator=torch.Generator().manual_seed(1)))
    longreach.apply(model, name, **(params if name == "dpe" else METHODS[name]))
    x, mask = left_padded(n=40, pad=5)
    settings = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, cache_implementation="static")
    eager = model.generate(x, **settings)
    config = transformers.CompileConfig(fullgraph=True, backend="eager")
    config._compile_all_devices = True
    assert torch.equal(model.generate(x, compile_config=config, **settings), eager)


@pytest.mark.parametrize("name", ["rerope", "self_extend"])
def test_kept_moved_keys_give_the_same_tokens_and_move_only_new_keys(monkeypatch, name):
    """``keep_moved_keys``: a decoding step moves its new key only; generate (greedy, beams, a static cache), a cropped
    cache given other tokens, and a second prompt all give what moving every key gives."""
    from longreach.attention import shifts

    model = tiny_model("llama")
    x, mask = left_padded(40)
    settings = dict(attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    want = {}
    longreach.apply(model, name, **METHODS[name])
    with torch.no_grad():
        want["greedy"], want["beams"] = model.generate(x, **settings), model.generate(x, num_beams=2, **settings)
        want["other"] = model.generate(ids(33, seed=5), **settings | {"attention_mask": None})
    longreach.apply(model, name, keep_moved_keys=True, **METHODS[name])
    moved = []
    real = shifts.shifted_keys
    monkeypatch.setattr(
        shifts, "shifted_keys", lambda key, *args, **kwargs: moved.append(key.shape[2]) or real(key, *args, **kwargs)
    )
    with torch.no_grad():
        assert torch.equal(model.generate(x, **settings), want["greedy"])
        assert moved[:2] == [40, 40] and set(moved[2:]) == {
            1
        }  # the prompt in each of 2 layers, then one key per step and layer
        assert torch.equal(model.generate(x, num_beams=2, **settings), want["beams"])
        assert torch.equal(model.generate(ids(33, seed=5), **settings | {"attention_mask": None}), want["other"])
        assert torch.equal(model.generate(x, cache_implementation="static", **settings), want["greedy"])
        cache = transformers.DynamicCache(config=model.config)
        model(x, attention_mask=mask, past_key_values=cache)
        cache.crop(-32)  # the cache now ends at 8 tokens; other tokens follow, in the slots of kept moved keys
        follow, follow_mask = ids(40, seed=9), torch.cat((mask[:, :8], torch.ones(2, 40, dtype=torch.long)), dim=1)
        got = model(follow, attention_mask=follow_mask, past_key_values=cache).logits
    longreach.apply(model, name, **METHODS[name])
    with torch.no_grad():
        cache = transformers.DynamicCache(config=model.config)
        model(x[:, :8], attention_mask=mask[:, :8], past_key_values=cache)
        expected = model(follow, attention_mask=follow_mask, past_key_values=cache).logits
    assert (got - expected).abs().max() <= 1e-5
    with pytest.raises(ValueError, match="keep_moved_keys must be True or False, got 'yes'"):
        longreach.apply(model, name, keep_moved_keys="yes", **METHODS[name])

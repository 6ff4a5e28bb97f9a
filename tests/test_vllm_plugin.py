"""The vLLM plugin's guards, without vLLM (``make test``; ``tests/test_vllm.py`` runs the plugin in vLLM itself): the
RoPE layouts it refuses in one line, and the releases it registers its backends on, against a stand-in ``vllm``."""

import os
import subprocess
import sys
import types
import warnings

import pytest
import transformers

from longreach.integrations import vllm as plugin


def stand_in_vllm(monkeypatch, version: str) -> list:
    """A ``vllm`` of ``version`` whose backend registry records what is registered (returned)."""
    registered = []
    registry = types.ModuleType("vllm.v1.attention.backends.registry")
    registry.AttentionBackendEnum = types.SimpleNamespace(CPU_ATTN="CPU_ATTN", FLASH_ATTN="FLASH_ATTN")
    registry.register_backend = lambda backend, path: registered.append((backend, path))
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setattr(sys.modules["vllm"], "__version__", version, raising=False)
    monkeypatch.setitem(sys.modules, "vllm.v1.attention.backends.registry", registry)
    monkeypatch.setenv(plugin.LOADED, "0")  # restored (absent) after the test; register sets it
    monkeypatch.delenv(plugin.LOADED)
    return registered


@pytest.mark.parametrize("version", ["0.32.0", "0.32.1+cpu", "0.33.0"])
def test_a_tested_release_gets_longreachs_backends(monkeypatch, version):
    registered = stand_in_vllm(monkeypatch, version)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plugin.register()
    assert registered == [
        ("CPU_ATTN", "longreach.integrations.vllm_cpu.LongreachCPUBackend"),
        ("FLASH_ATTN", "longreach.integrations.vllm_cuda.LongreachFlashAttentionBackend"),
    ]


def test_the_first_process_to_load_the_plugin_prepares_the_kernel_and_its_children_do_not(monkeypatch):
    """Issue trust4, defect 11: vLLM's main process builds the CPU kernel before its engine and workers start; they,
    its children, inherit the mark and never build."""
    stand_in_vllm(monkeypatch, "0.32.0")
    prepared = []
    monkeypatch.setattr(plugin, "prepare", lambda: prepared.append(True))
    plugin.register()
    assert prepared == [True] and os.environ[plugin.LOADED] == str(os.getpid())
    child = subprocess.run(
        [sys.executable, "-c", f"import os; print(os.environ.get({plugin.LOADED!r}))"], capture_output=True, text=True
    )
    assert child.stdout.strip() == str(os.getpid())  # what vLLM's engine and workers see
    plugin.register()  # as a child does: the mark is there
    assert prepared == [True]


@pytest.mark.parametrize("version", ["0.34.0", "0.31.2", "1.32.0"])
def test_another_release_is_left_as_it_is_with_one_warning(monkeypatch, version):
    """Issue trust4, defect 9: a release that may have moved the internals the backends import is not touched."""
    registered = stand_in_vllm(monkeypatch, version)
    with pytest.warns(UserWarning) as caught:
        plugin.register()
    assert registered == [] and len(caught) == 1
    assert str(caught[0].message) == (
        f"longreach: vLLM {version} is not a release longreach's plugin is tested with (0.32, 0.33): vLLM is left as "
        "it is (its own attention; a model whose config holds a longreach record runs without its method)"
    )
    config = transformers.LlamaConfig(max_position_embeddings=4096)
    with pytest.raises(
        ValueError, match=rf"^vLLM {version} is not a release .*: its attention methods do not run on it$"
    ):
        plugin.overrides("string")(config)
    plugin.overrides("yarn", factor=2.0)(config)  # vLLM's own rotary embedding: any release


def test_a_rope_per_layer_type_is_read_for_full_and_sliding_layers_and_refused_for_others():
    """Gemma 3's config has a RoPE base and scaling per layer type and none at the top: each layer reads its type's
    (issue trust4, defect 10, found every layer read a base of 10,000). Layer types the backends cannot tell apart
    are refused in one line."""
    config = transformers.Gemma3TextConfig(max_position_embeddings=4096)
    assert plugin.model_problem(config) is None
    assert set(plugin.layer_ropes(config)) == {"full_attention", "sliding_attention"}
    chunked = types.SimpleNamespace(rope_parameters={"chunked_attention": {"rope_theta": 1e4}})
    assert plugin.model_problem(chunked) == (
        "rope_parameters of layer type chunked_attention: longreach's methods in vLLM know the RoPE of full_attention "
        "and sliding_attention layers only"
    )
    other = types.SimpleNamespace(rope_parameters={"full_attention": {"rope_type": "deepseek_yarn", "rope_theta": 1e4}})
    assert plugin.model_problem(other).startswith("rope_parameters['full_attention'].rope_type='deepseek_yarn': ")


def test_a_rope_without_its_base_is_refused():
    config = types.SimpleNamespace(max_position_embeddings=4096, rope_parameters={"rope_type": "default"})
    assert plugin.model_problem(config) == (
        "rope_parameters has no rope_theta: longreach's methods in vLLM read the RoPE base from it"
    )
    assert plugin.model_problem(transformers.LlamaConfig()) is None


def test_the_short_path_is_the_plugins_own():
    import longreach.vllm

    assert longreach.vllm.overrides is plugin.overrides and longreach.vllm.prepare is plugin.prepare
    assert longreach.vllm.overrides("string", local_window=9).json == plugin.overrides("string", local_window=9).json


def test_a_saved_composition_the_configs_rope_cannot_hold_is_refused_and_one_it_holds_runs():
    """A model saved after ``apply(..., scaling=...)``: over plain RoPE its rope_parameters hold the frequency method,
    which vLLM's rotary embedding computes; over the model's own scaling they stay the model's (transformers cannot
    write the composition there), and vLLM would run without it, so it is refused."""
    own = {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}
    record = {"method": "string", "params": {}, "training_window": 512, "scaling": {"rope_type": "ntk", "factor": 2.0}}
    over_own = types.SimpleNamespace(
        max_position_embeddings=4096, rope_parameters=own, longreach={**record, "replaced_rope_parameters": own}
    )
    with pytest.raises(ValueError, match=r"^scaling=\{'rope_type': 'ntk', 'factor': 2.0\}: the model's rope_param"):
        plugin.methods_of(over_own)
    plain = {"rope_type": "default", "rope_theta": 1e4}
    over_plain = types.SimpleNamespace(
        max_position_embeddings=4096,
        rope_parameters={**plain, "rope_theta": 4e4},
        longreach={**record, "replaced_rope_parameters": plain},
    )
    method, drop = plugin.methods_of(over_plain)
    assert method.name == "string" and drop is None
    frequency_alone = types.SimpleNamespace(
        max_position_embeddings=4096, rope_parameters=plain, longreach={**record, "method": "rope"}
    )
    assert plugin.methods_of(frequency_alone) is None  # vLLM's own attention


@pytest.mark.parametrize(
    "method, params, message",
    [
        ("string", {"bogus": 1}, "string has no parameter bogus; its parameters: shift, local_window, mscale"),
        ("string", {"shift": "x"}, "shift must be an integer (local_window < shift < L), got 'x'"),
        ("string", {"shift": 2.5}, "shift must be an integer (local_window < shift < L), got 2.5"),
        ("yarn", {"factor": 0.5}, "factor=0.5 is out of range: a number >= 1"),
        ("yarn", {"factor": float("nan")}, "factor=nan is out of range: a number >= 1"),
        ("rerope", {"leak": float("nan")}, "leak=nan is out of range"),
        ("drop", {"rate": 5}, "rate=5 is out of range: 0 <= rate < 1"),
        ("dpe", {"group_scales": (-1,), "top_k": None}, "group_scales=-1 is out of range"),
        ("dca", {"chunk_size": 100, "local_window": 200}, "local_window=200 is out of range: 0 < local_window < chunk"),
        ("string", {"training_window": -5}, "training_window=-5 is out of range: the model's L, a whole number of"),
        ("string", {"training_window": 0}, "training_window=0 is out of range: the model's L"),
        ("string", {"training_window": 1.5}, "training_window must be an integer (the model's L, a whole number of"),
        ("string", {"training_window": True}, "training_window must be an integer"),
        ("string", {"training_window": "x"}, "training_window must be an integer"),
        ("string", {"training_window": float("nan")}, "training_window must be an integer"),
        ("rope", {"training_window": -5}, "training_window=-5 is out of range"),
    ],
)
def test_a_record_is_checked_at_once_without_the_model(method, params, message):
    """Issue trust5, defects 13 and 15: without ``training_window`` these were accepted, then refused when vLLM read
    the config; ``training_window=-5`` blamed ``shift``."""
    with pytest.raises(ValueError) as refused:
        plugin.overrides(method, **params)
    assert str(refused.value).startswith(message)


def test_numpy_numbers_make_a_record_as_pythons_do():
    """Defect 14: ``shift=np.int64(100)`` was not JSON; ``context=np.int64(4096)`` was out of range."""
    import numpy as np

    assert plugin.overrides("string", shift=np.int64(100)).json == plugin.overrides("string", shift=100).json
    assert plugin.overrides("string", training_window=np.int64(4096), context=np.int64(8192)).json == (
        plugin.overrides("string", training_window=4096, context=8192).json
    )
    assert plugin.overrides("rerope", window=np.int64(100)).record["params"] == {"window": 100}
    dpe = plugin.overrides("dpe", local_window=np.int64(100), group_scales=np.array([1, 2]), top_k=None)
    assert dpe.record["params"] == {"local_window": 100, "group_scales": [1, 2], "top_k": None}
    assert plugin.overrides("string", shift=100).record["training_window"] is None  # the window is checked later

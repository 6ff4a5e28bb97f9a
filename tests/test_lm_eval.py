"""lm-evaluation-harness: ``LongreachLM`` and ``python -m longreach.lm_eval``, offline.

lm-eval's own tasks download their data at run time, so three local tasks (YAML with local
``data_files``) cover its three request types: ``generate_until``, ``loglikelihood`` (multiple
choice) and ``loglikelihood_rolling``. The model is tiny (L = 64) with the real SmolLM2 tokenizer;
the prompts run past ``L``, so STRING changes the answers (tests/helpers/: the tasks, the model).
"""

import json
import os
import subprocess
import sys

import pytest

lm_eval = pytest.importorskip("lm_eval")

from helpers.lm_eval_tasks import STRING, loglikelihoods, passage, write_task, write_tasks  # noqa: E402
from helpers.tiny_models import save_tiny_llama  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

import longreach  # noqa: E402
from longreach.lm_eval import LongreachLM  # noqa: E402

COMMON = dict(device="cpu", batch_size=2, max_length=256, dtype="float32")
TASKS = ["lr_tiny_gen", "lr_tiny_choice", "lr_tiny_rolling"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """``(model folder, task folder)``: a tiny Llama saved with the real tokenizer, and the three tasks."""
    folder = tmp_path_factory.mktemp("lm_eval")
    save_tiny_llama(folder / "model")
    tasks = write_tasks(folder / "tasks")
    write_task(
        tasks,
        "lr_tiny_rolling",
        "loglikelihood_rolling",
        [{"text": passage(s, n)} for s, n in enumerate([40, 200])],  # 200 words: more than one window of 256 tokens
        'doc_to_text: ""\ndoc_to_target: "{{text}}"\nmetric_list:\n  - metric: word_perplexity\n',
    )
    return folder / "model", tasks


def samples(lm, tasks) -> dict:
    """Per task, every request's raw response (generated text, or log-likelihoods), in document order."""
    manager = TaskManager(include_path=str(tasks))
    out = lm_eval.simple_evaluate(model=lm, tasks=TASKS, task_manager=manager, log_samples=True, random_seed=0)
    return {
        task: [s["resps"] for s in sorted(rows, key=lambda s: s["doc_id"])] for task, rows in out["samples"].items()
    }


def assert_same(ours: dict, theirs: dict, tolerance: float) -> None:
    assert ours["lr_tiny_gen"] == theirs["lr_tiny_gen"]
    for task in ("lr_tiny_choice", "lr_tiny_rolling"):
        assert loglikelihoods(ours[task]) == pytest.approx(loglikelihoods(theirs[task]), abs=tolerance, rel=0)


@pytest.fixture(scope="module")
def evaluated(setup):
    """Every task's responses with ``LongreachLM`` under ``rope`` and under STRING, evaluated once for the tests
    below."""
    folder, tasks = setup
    string = LongreachLM(pretrained=str(folder), **STRING, **COMMON)
    assert longreach.describe(string.model).startswith("string(shift=16, local_window=4")
    return {
        "rope": samples(LongreachLM(pretrained=str(folder), method="rope", **COMMON), tasks),
        "string": samples(string, tasks),
    }


@pytest.mark.slow
def test_rope_reproduces_lm_evals_own_hf_model(setup, evaluated):
    folder, tasks = setup
    plain = samples(HFLM(pretrained=str(folder), **COMMON), tasks)
    assert_same(evaluated["rope"], plain, 1e-4)


@pytest.mark.slow
def test_string_equals_longreachs_own_api_and_changes_the_answers(setup, evaluated):
    folder, tasks = setup
    ours, rope = evaluated["string"], evaluated["rope"]
    model, _ = longreach.load(str(folder))
    direct = samples(HFLM(pretrained=longreach.apply(model, **STRING), **COMMON), tasks)
    assert_same(ours, direct, 1e-5)
    changes = [
        abs(a - b)
        for a, b in zip(loglikelihoods(ours["lr_tiny_choice"]), loglikelihoods(rope["lr_tiny_choice"]), strict=True)
    ]
    assert changes[:3] == pytest.approx(
        [0.0] * 3, abs=1e-5
    )  # the first prompt fits in the local window: STRING is RoPE there
    assert max(changes) > 5e-4  # a random tiny model is nearly uniform, yet the long prompts move 50x the tolerance


def test_method_parameters_are_split_from_lm_evals_and_checked_before_loading(setup, monkeypatch):
    folder, _ = setup
    lm = LongreachLM(
        pretrained=str(folder),
        method="self_extend",
        group_size=2,
        neighbor_window=8,
        scaling="yarn",
        factor=2.0,
        drop="dynamic_drop",
        layers=(0,),
        **COMMON,
    )
    assert "self_extend(group_size=2, neighbor_window=8)" in longreach.describe(lm.model)
    assert lm.model.config.rope_parameters["rope_type"] == "yarn"
    loaded = []
    monkeypatch.setattr(HFLM, "_create_model", lambda *a, **k: loaded.append(True))
    with pytest.raises(ValueError, match="shift=100 is out of range"):
        LongreachLM(pretrained=str(folder), method="string", shift=100, **COMMON)
    with pytest.raises(ValueError, match="method='nope' is not a longreach method"):
        LongreachLM(pretrained=str(folder), method="nope", **COMMON)
    with pytest.raises(ValueError, match="batch_size=4 with dynamic NTK"):
        LongreachLM(pretrained=str(folder), method="string", scaling="dynamic", **{**COMMON, "batch_size": 4})
    assert not loaded  # the method was checked on an empty model, before any weight was read


def test_model_arguments_given_as_text_are_read_as_the_command_line_reads_them():
    """lm-eval's --model_args hands lists and None on as strings (DPE's scales, drop layers)."""
    from longreach.lm_eval import _claim

    arguments = {"group_scales": "2;4;1;8", "top_k": "none", "local_window": 16, "batch_size": 2}
    assert _claim("dpe", "method", arguments) == {"group_scales": (2, 4, 1, 8), "top_k": None, "local_window": 16}
    assert arguments == {"batch_size": 2}


def run_cli(*args: str, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "longreach.lm_eval", *args], capture_output=True, text=True, cwd=cwd, env=env
    )


@pytest.mark.slow
def test_command_line_is_lm_evals_with_the_longreach_model(setup, evaluated, tmp_path):
    folder, tasks = setup
    model_args = f"pretrained={folder},method=string,shift=16,local_window=4,max_length=256,dtype=float32"
    done = run_cli(
        "--model_args",
        model_args,
        "--tasks",
        "lr_tiny_choice",
        "--include_path",
        str(tasks),
        "--device",
        "cpu",
        "--batch_size",
        "2",
        "--output_path",
        str(tmp_path / "out"),
        "--log_samples",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    [result] = list((tmp_path / "out").rglob("results_*.json"))
    cli_samples = [
        json.loads(line)
        for path in (tmp_path / "out").rglob("samples_lr_tiny_choice_*.jsonl")
        for line in path.read_text().splitlines()
    ]
    cli = [s["resps"] for s in sorted(cli_samples, key=lambda s: s["doc_id"])]
    assert loglikelihoods(cli) == pytest.approx(loglikelihoods(evaluated["string"]["lr_tiny_choice"]), abs=1e-5, rel=0)
    assert json.loads(result.read_text())["results"]["lr_tiny_choice"]["acc,none"] is not None


@pytest.mark.slow
def test_command_line_errors_are_one_line(setup, tmp_path):
    folder, tasks = setup
    done = run_cli(
        "--model_args",
        f"pretrained={folder},method=string,shift=100",
        "--tasks",
        "lr_tiny_choice",
        "--include_path",
        str(tasks),
        "--device",
        "cpu",
        cwd=tmp_path,
    )
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("longreach: error: shift=100 is out of range") and "Traceback" not in done.stderr


def test_missing_lm_eval_names_the_install_command(monkeypatch):
    for name in [m for m in sys.modules if m == "lm_eval" or m.startswith(("lm_eval.", "longreach.lm_eval"))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    with pytest.raises(
        ImportError,
        match=r'run: pip install "lm_eval>=0.4.13,<0.5" \(or, in a clone of longreach: '
        r'pip install -e "\.\[lm-eval\]"\)',
    ):
        import longreach.lm_eval  # noqa: F401


def test_the_model_is_declared_for_lm_evals_entry_points():
    from importlib.metadata import entry_points

    [entry] = [e for e in entry_points(group="lm_eval.models") if e.name == "longreach"]
    assert entry.load() is LongreachLM

"""Several processes under ``torchrun`` (two gloo processes on the CPU): tensor parallelism, data-parallel
evaluations, and a model split with accelerate's ``device_map``. Each must equal one process."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.tiny_models import save_tiny_llama

import longreach
from longreach import models

pytestmark = pytest.mark.distributed
TORCHRUN = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
needs_torchrun = pytest.mark.skipif(TORCHRUN is None, reason="torchrun is not installed")
WORKERS = Path(__file__).parent / "workers"
EVAL = [
    "eval",
    "passkey",
    "--lengths",
    "256",
    "--samples",
    "3",
    "--method",
    "rope",
    "--method",
    "string:shift=16,local_window=4",
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A tiny Llama (L = 64, 2 KV heads: splits over 2 processes) saved with the real tokenizer."""
    folder = tmp_path_factory.mktemp("distributed") / "model"
    save_tiny_llama(folder, window=64)
    return folder


def torchrun(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [TORCHRUN, "--standalone", "--nproc-per-node", "2", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def answers(out: Path) -> list[tuple]:
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines() if line.strip()]
    return sorted((r["method"], r["task"], r["length"], r["seed"], r["answer"], r["score"]) for r in records)


def single_process(folder: Path, out: Path) -> list[tuple]:
    subprocess.run(
        [sys.executable, "-m", "longreach", *EVAL, "--model", str(folder), "--out", str(out)],
        check=True,
        capture_output=True,
        cwd=out.parent,
    )
    return answers(out)


@needs_torchrun
def test_tensor_parallel_prefill_and_generate_equal_one_process(folder, tmp_path, monkeypatch):
    torchrun(str(WORKERS / "tensor_parallel.py"), str(folder), str(tmp_path / "tp.pt"), cwd=tmp_path)
    sharded = torch.load(tmp_path / "tp.pt")
    assert sharded["sharded"] == "DTensor"  # the weights really were split
    monkeypatch.syspath_prepend(str(WORKERS))
    from tensor_parallel import compute

    whole = compute(models.load(str(folder))[0])
    torch.testing.assert_close(sharded["logits"], whole["logits"], atol=2e-5, rtol=0)
    assert torch.equal(sharded["generated"], whole["generated"])


@needs_torchrun
def test_tensor_parallel_evaluation_equals_one_process(folder, tmp_path):
    torchrun("-m", "longreach", *EVAL, "--model", str(folder), "--out", str(tmp_path / "tp"), "--tp", cwd=tmp_path)
    assert answers(tmp_path / "tp") == single_process(folder, tmp_path / "single")


@needs_torchrun
def test_data_parallel_evaluation_runs_each_case_once_merges_and_resumes(folder, tmp_path):
    out = tmp_path / "dp"
    first = torchrun("-m", "longreach", *EVAL, "--model", str(folder), "--out", str(out), cwd=tmp_path)
    assert (
        "process 0 of 2: 4 cases in the grid" in first.stdout and "process 1 of 2: 2 cases in the grid" in first.stdout
    )
    assert answers(out) == single_process(folder, tmp_path / "single")  # 6 records: each case once
    assert not list(out.glob("results.rank*.jsonl"))  # merged into results.jsonl
    # a crash before the merge leaves a process's share behind: the rerun counts it as done and merges it
    records = (out / "results.jsonl").read_text().splitlines()
    (out / "results.jsonl").write_text("\n".join(records[:4]) + "\n")
    (out / "results.rank1.jsonl").write_text("\n".join(records[4:]) + "\n")
    again = torchrun("-m", "longreach", *EVAL, "--model", str(folder), "--out", str(out), cwd=tmp_path)
    assert "running 0" in again.stdout
    assert len(answers(out)) == 6 and not list(out.glob("results.rank*.jsonl"))


def test_tp_outside_torchrun_is_a_one_line_error(folder, tmp_path, capsys):
    from longreach import cli

    with pytest.raises(SystemExit) as stop:
        cli.main([*EVAL, "--model", str(folder), "--out", str(tmp_path / "x"), "--tp"])
    assert stop.value.code.startswith("longreach: error: --tp shards the model over processes: start under torchrun")


def test_a_model_split_with_device_map_equals_the_whole_model(folder):
    """accelerate's hooks (``device_map``) move activations between the parts; the applied method is unchanged."""
    from accelerate import dispatch_model

    whole = longreach.apply(models.load(str(folder))[0], "string", shift=16, local_window=4)
    split = models.load(str(folder))[0]
    device_map = {
        "model.embed_tokens": "cpu",
        "model.layers.0": "cpu",
        "model.layers.1": "cpu",
        "model.norm": "cpu",
        "model.rotary_emb": "cpu",
        "lm_head": "cpu",
    }
    split = longreach.apply(
        dispatch_model(split, device_map=device_map, force_hooks=True), "string", shift=16, local_window=4
    )
    assert hasattr(split.model.layers[1], "_hf_hook")  # the hooks are in place
    ids = torch.arange(5, 105)[None] * 37 % 4000
    with torch.no_grad():
        torch.testing.assert_close(split(ids).logits, whole(ids).logits, atol=0, rtol=0)
        assert torch.equal(
            split.generate(ids, max_new_tokens=6, do_sample=False),
            whole.generate(ids, max_new_tokens=6, do_sample=False),
        )

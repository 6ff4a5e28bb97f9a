"""bench/gpu.sh, the first two commands of a session lent a GPU, run through on the CPU (``--device cpu``)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from longreach.attention import backends

ROOT = Path(__file__).resolve().parents[1]


def gpu_script(*arguments: str, out: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable}
    script = str(ROOT / "bench" / "gpu.sh")
    return subprocess.run(["bash", script, *arguments], env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_both_parts_dry_run_on_the_cpu_and_write_everything_under_out(tmp_path):
    """Part 1, decoding first: the decoding table with the kernel SDPA picked, generate compiled against eager (JSON),
    the prefill table, the probe (JSON: which backend ran each timed call), the FlashAttention emulation's check (JSON);
    part 2: the CUDA tests in three groups (skipped here, junit written), the default model end to end. Each step's
    status is in steps.tsv; bench/RESULTS.md is left alone."""
    results = ROOT / "bench" / "RESULTS.md"
    before = results.read_text()
    for part in ("1", "2"):
        done = gpu_script(part, "--device", "cpu", out=tmp_path)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert results.read_text() == before
    steps = [line.split("\t") for line in (tmp_path / "steps.tsv").read_text().splitlines()]
    assert [name for name, *_ in steps] == [
        "decode-auto",
        "generate",
        "prefill-auto",
        "probe",
        "emulation",
        "tests-new",
        "tests-kernel",
        "tests-models",
        "model",
    ]
    assert all(status == "0" for _, status, _ in steps), steps
    for group in ("new", "kernel", "models"):
        assert "testsuite" in (tmp_path / f"tests-{group}.xml").read_text()
    probe = json.loads((tmp_path / "gpu_probe_kernels.json").read_text())
    generated = json.loads((tmp_path / "gpu_probe_generate.json").read_text())["generate"]
    emulation = json.loads((tmp_path / "flash_emulation.json").read_text())  # the dry run: against a dense softmax
    assert len(emulation["cases"]) == 5 and all(case["ok"] for case in emulation["cases"])
    assert probe["auto"]["prefill"] in backends.REGISTRY
    assert probe["ran"]["string_cpu_flash_1024"] == ["cpu_flash"]
    ran_for_auto = probe["ran"]["string_auto_1024"]  # auto's choice, or the backend it handed the calls on to
    assert len(ran_for_auto) == 1 and ran_for_auto[0] in backends.REGISTRY
    for method in ("sdpa", "string", "rerope"):  # generate compiled (Dynamo alone here) gives eager's tokens
        assert generated[f"{method}_first_8_tokens_against_eager"]["tokens_equal"] == 8
        assert isinstance(generated[f"{method}_ms_per_token"], float)
    written = (tmp_path / "RESULTS.md").read_text()
    assert "## Attention, causal prefill, time, n = 512,1024" in written and "## Attention, decoding step" in written
    assert "## End to end, the default model at 512 tokens" in written
    assert "SmolLM2-135M-Instruct (random weights)" in written  # as on the GPU machine, which cannot be sent the model
    assert "scaled_dot_product" in written  # the kernel SDPA picked, per length
    for method in ("string", "rerope", "self_extend", "dca"):
        assert f"| {method} | 1024 |" in written


def test_the_gpu_script_refuses_an_unknown_device_or_part(tmp_path):
    done = gpu_script("1", "--device", "tpu", out=tmp_path)
    assert done.returncode == 2 and done.stderr.strip() == "bench/gpu.sh: --device tpu is not one of: cuda, cpu"
    done = gpu_script("--device", "cpu", out=tmp_path)
    assert done.returncode == 2 and "which part? 1 (probe and benchmarks) or 2 (CUDA tests)" in done.stderr

"""bench/gpu.sh, the first command of a session lent a GPU, runs through on the CPU (``--device cpu``)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_gpu_script_dry_runs_on_the_cpu_without_touching_the_results(tmp_path):
    """Every step runs at small sizes: the CUDA tests (skipped here, junit written), the attention benchmark in
    prefill and decoding with the kernel SDPA picked, the default model end to end; tables go to $OUT."""
    results = ROOT / "bench" / "RESULTS.md"
    before = results.read_text()
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu.sh"), "--device", "cpu"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert results.read_text() == before
    assert "testsuite" in (tmp_path / "cuda-tests.xml").read_text()
    written = (tmp_path / "RESULTS.md").read_text()
    assert "## Attention, causal prefill, time, n = 512,1024" in written and "## Attention, decoding step" in written
    assert "## End to end, the default model at 512 tokens" in written
    assert "SmolLM2-135M-Instruct (random weights)" in written  # as on the GPU machine, which cannot be sent the model
    assert "scaled_dot_product" in written  # the kernel SDPA picked, per length
    for method in ("string", "rerope", "self_extend", "dca"):
        assert f"| {method} | 1024 |" in written


def test_the_gpu_script_refuses_an_unknown_device():
    done = subprocess.run(["bash", str(ROOT / "bench" / "gpu.sh"), "--device", "tpu"], capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.strip() == "bench/gpu.sh: --device tpu is not one of: cuda, cpu"

"""The first minutes of a GPU session: does every path that has never run on a GPU work, which backend does
``auto`` take, and what does each route cost against SDPA, in one short run (bench/gpu.sh, part 1).

    OUT=folder python bench/gpu_probe.py [--device cuda|cpu]

Every item runs on its own (a failure is a finding, written as ``ERROR ...``), and ``$OUT/gpu_probe.json`` is
rewritten after each, so a run cut short keeps what it measured. The Triton kernel runs last: an illegal
address is sticky and would poison what follows. Checks compare with the math backend in float32 on the same
bfloat16 inputs; times are CUDA events (the CPU: wall clock), medians of 5 after one warm-up.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from longreach.attention import backends, kernel
from longreach.methods import create

RESULTS: dict = {"env": {}, "checks": {}, "auto": {}, "ms": {}, "peak_mib": {}}


def record(kind: str, name: str, measure) -> None:
    """``RESULTS[kind][name] = measure()``, or the error it raised; written out at once."""
    started = time.time()
    try:
        RESULTS[kind][name] = measure()
    except Exception as error:  # every failure is a finding
        RESULTS[kind][name] = f"ERROR {type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"
        traceback.print_exc(limit=3)
    print(f"[{time.time() - started:6.1f} s] {kind}/{name}: {RESULTS[kind][name]}", flush=True)
    (Path(os.environ.get("OUT", "bench/out")) / "gpu_probe.json").write_text(json.dumps(RESULTS, indent=1, default=str))


def timed(run, device: torch.device, rounds: int = 5) -> float:
    """Median milliseconds of ``run()`` after one warm-up."""
    run()
    times = []
    for _ in range(rounds):
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop))
        else:
            began = time.perf_counter()
            run()
            times.append((time.perf_counter() - began) * 1000)
    return round(statistics.median(times), 3)


def layer(n: int, device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, dim: int):
    """Random rotated ``q``, ``k``, ``v`` of a layer, and its ``inv_freq``."""
    generator = torch.Generator(device=device).manual_seed(0)
    q, k, v = (
        torch.randn(1, h, n, dim, device=device, dtype=dtype, generator=generator) for h in (heads, kv_heads, kv_heads)
    )
    return q, k, v, 1.0 / (10000 ** (torch.arange(0, dim, 2, device=device).float() / dim))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    device = torch.device(parser.parse_args().device)
    cuda = device.type == "cuda"
    dtype, heads, kv_heads, dim = (torch.bfloat16, 32, 8, 128) if cuda else (torch.float32, 4, 2, 32)
    RESULTS["env"] = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if cuda else "cpu",
                      "cudnn": torch.backends.cudnn.version() if cuda else None}  # fmt: skip
    print(RESULTS["env"], flush=True)

    small = 1000 if cuda else 200
    q, k, v, inv_freq = layer(small, device, dtype, heads, kv_heads, dim)
    for name, params in (("string", {}), ("rerope", {}), ("dca", {})):
        parts = create(name, training_window=small).parts()
        want = kernel.attention(q.float(), k.float(), v.float(), parts, inv_freq, backend="math")
        on_cpu = ["auto", "cpu_fused", "cpu_flash", "flex", "math"]
        names = [b for b in backends.names() if b != "triton"] + ["triton"] if cuda else on_cpu  # Triton last
        for backend in names:
            record("checks", f"{name}_{backend}_max_error", lambda: max_error(q, k, v, parts, inv_freq, backend, want))
    for what, length in (("prefill", 4096), ("decoding step", 1)):
        query = torch.empty(1, heads, length, dim, device=device, dtype=dtype)
        record("auto", what, lambda: backends.pick(query, "auto", fusable=True).name)
    if cuda:
        cudnn = torch.ops.aten._scaled_dot_product_cudnn_attention
        record(
            "checks",
            "cudnn_op_takes_grouped_heads",
            lambda: list(cudnn(q, k, v, None, True, 0.0, True, False)[0].shape),
        )

    for n in (8192, 32768, 131072) if cuda else (512, 1024):
        q, k, v, inv_freq = layer(n, device, dtype, heads, kv_heads, dim)
        parts = create("string", training_window=n).parts()
        sdpa = functools.partial(F.scaled_dot_product_attention, q, k, v, is_causal=True, enable_gqa=True)
        record("ms", f"sdpa_{n}", lambda: timed(sdpa, device))
        if cuda:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            for kind in ("FLASH_ATTENTION", "CUDNN_ATTENTION"):
                record("ms", f"sdpa_{kind.lower()}_{n}", lambda: _forced(kind, sdpa, device, SDPBackend, sdpa_kernel))
        names = ("auto", "cuda_cudnn", "flex", "cuda_flash", "triton") if cuda else ("auto", "cpu_flash")
        for backend in names:
            run = functools.partial(kernel.attention, q, k, v, parts, inv_freq, backend=backend)
            record("ms", f"string_{backend}_{n}", lambda: timed(run, device))
            if cuda:
                record("peak_mib", f"string_{backend}_{n}", lambda: _peak(run))
        if cuda:
            torch.cuda.empty_cache()


def max_error(q, k, v, parts, inv_freq, backend: str, want: torch.Tensor) -> float:
    """The largest difference between ``backend``'s attention and ``want``."""
    return round((kernel.attention(q, k, v, parts, inv_freq, backend=backend).float() - want).abs().max().item(), 4)


def _forced(kind, sdpa, device, SDPBackend, sdpa_kernel) -> float:
    with sdpa_kernel(getattr(SDPBackend, kind)):
        return timed(sdpa, device)


def _peak(run) -> float:
    """Peak memory of one call beyond what was allocated before it, MiB."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    run()
    torch.cuda.synchronize()
    return round((torch.cuda.max_memory_allocated() - before) / 2**20, 1)


if __name__ == "__main__":
    main()

"""bench/RESULTS.md: each benchmark run owns one ``## title`` section and replaces it when run again."""

from __future__ import annotations

import contextlib
import os
import platform
import re
import time
from datetime import date
from pathlib import Path
from unittest import mock

RESULTS = Path(os.environ.get("BENCH_RESULTS") or Path(__file__).with_name("RESULTS.md"))
"""Where sections are written: bench/RESULTS.md, or the file ``$BENCH_RESULTS`` names (``bench/gpu.sh --device
cpu``'s dry run)."""


def write_section(title: str, body: str) -> None:
    """Put ``body`` under ``## title`` in RESULTS.md (dated), replacing an older section of that title."""
    text = RESULTS.read_text() if RESULTS.exists() else "# Benchmarks\n"
    section = f"## {title}\n\nMeasured {date.today().isoformat()}.\n\n{body.strip()}\n\n"
    pattern = re.compile(rf"^## {re.escape(title)}\n.*?(?=^## |\Z)", re.DOTALL | re.MULTILINE)
    text = pattern.sub(lambda _: section, text) if pattern.search(text) else text.rstrip("\n") + "\n\n" + section
    RESULTS.write_text(text.rstrip("\n") + "\n")


def timed(run, device: str = "cpu") -> float:
    """Seconds one call of ``run`` takes; on a GPU, from an idle device, between two CUDA events around it."""
    import torch

    if torch.device(device).type != "cuda":
        start = time.perf_counter()
        run()
        return time.perf_counter() - start
    torch.cuda.synchronize(device)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) / 1e3


def busiest_kernel(run, device: str = "cpu") -> str:
    """The name of the kernel (CUDA) or operator (CPU) that takes most of one call of ``run``: which of its
    kernels SDPA picked (flash, memory-efficient, cuDNN, math), as the profiler saw it."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.device(device).type == "cuda"
    try:
        return _busiest(run, device, cuda, profile, ProfilerActivity)
    except (RuntimeError, AttributeError) as error:  # a label, never the reason a benchmark stops
        return f"unknown ({type(error).__name__})"


def _busiest(run, device, cuda, profile, ProfilerActivity) -> str:
    import torch

    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as profiler:
        run()
        if cuda:
            torch.cuda.synchronize(device)
    events = [
        e
        for e in profiler.key_averages()
        if (cuda and getattr(e.device_type, "name", "") == "CUDA") or (not cuda and e.key.startswith("aten::_"))
    ]
    if not events:
        return "unknown"
    time_of = (lambda e: getattr(e, "self_device_time_total", 0)) if cuda else (lambda e: e.self_cpu_time_total)
    return max(events, key=time_of).key[:80]


def machine(device: str) -> str:
    """What ran the benchmark, for the tables' headers."""
    import torch

    if torch.device(device).type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    return f"{device} ({platform.processor() or platform.machine()}, {os.cpu_count()} cores), torch {torch.__version__}"


@contextlib.contextmanager
def backends_that_ran():
    """The names of the backends whose ``run`` computes the calls made inside, in order: every backend of the registry
    has its ``run`` wrapped for the while."""
    ran: list[str] = []

    def noting(backend):
        run = backend.run

        def noted(*args, **kwargs):
            ran.append(backend.name)
            return run(*args, **kwargs)

        return noted

    from longreach.attention import backends

    with contextlib.ExitStack() as wrapped:
        for backend in backends.REGISTRY.values():
            wrapped.enter_context(mock.patch.object(backend, "run", noting(backend)))
        yield ran

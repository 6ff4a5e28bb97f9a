"""bench/RESULTS.md: each benchmark run owns one ``## title`` section and replaces it when run again."""

from __future__ import annotations

import os
import platform
import re
import time
from datetime import date
from pathlib import Path

RESULTS = Path(__file__).with_name("RESULTS.md")


def write_section(title: str, body: str) -> None:
    """Put ``body`` under ``## title`` in RESULTS.md (dated), replacing an older section of that title."""
    text = RESULTS.read_text() if RESULTS.exists() else "# Benchmarks\n"
    section = f"## {title}\n\nMeasured {date.today().isoformat()}.\n\n{body.strip()}\n\n"
    pattern = re.compile(rf"^## {re.escape(title)}\n.*?(?=^## |\Z)", re.DOTALL | re.MULTILINE)
    text = pattern.sub(lambda _: section, text) if pattern.search(text) else text.rstrip("\n") + "\n\n" + section
    RESULTS.write_text(text.rstrip("\n") + "\n")


def timed(run, device: "str | torch.device" = "cpu") -> float:
    """Seconds one call of ``run`` takes; on a GPU the queued work is waited for before and after."""
    import torch

    wait = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    wait()
    start = time.perf_counter()
    run()
    wait()
    return time.perf_counter() - start


def machine(device: str) -> str:
    """What ran the benchmark, for the tables' headers."""
    import torch

    if torch.device(device).type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    return f"{device} ({platform.processor() or platform.machine()}, {os.cpu_count()} cores), torch {torch.__version__}"

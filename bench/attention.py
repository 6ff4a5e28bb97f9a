"""Attention speed and peak memory of every method against causal SDPA, on the same q, k, v.

    python bench/attention.py [--lengths 4096,8192,16384] [--heads 8] [--dim 64] [--repeats 3]

Each measurement runs in a fresh process (so peak RSS is its own); times are the best of
``--repeats`` after one warm-up. Prints a markdown table of ratios against causal SDPA measured
in the same run, and writes it to bench/RESULTS.md with ``--write``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

METHODS = {"rope": {}, "string": {}, "rerope": {}, "self_extend": {}, "dca": {}}  # defaults for L = n
DROPS = {"drop": {"rate": 0.3}, "dynamic_drop": {}}  # every row dropped; DDA with L = n/2 (half the rows beyond it)


def measure(method: str, n: int, heads: int, dim: int, repeats: int, device: str) -> dict:
    import resource

    import torch

    from longreach.attention import kernel
    from longreach.methods import create, drop

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, heads, n, dim, device=device) for _ in range(3))
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, device=device).float() / dim))
    if method == "sdpa":
        run = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    elif method in DROPS:
        positions = torch.arange(n, device=device)[None]
        rates = drop.create(method, **DROPS[method]).rates(positions, n // 2, generated=False)
        parts = create("rope", training_window=n).parts()
        run = lambda: kernel.attention(q, k, v, parts, inv_freq, drop=rates)
    else:
        parts = create(method, training_window=n, **METHODS[method]).parts()
        run = lambda: kernel.attention(q, k, v, parts, inv_freq)
    run()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    best = float("inf")
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        run()
        sync()
        best = min(best, time.perf_counter() - start)
    if device == "cuda":
        peak = torch.cuda.max_memory_allocated() - 4 * q.numel() * q.element_size()
    else:  # the child runs with a fixed glibc mmap threshold, so RSS tracks live memory
        peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
    return {"seconds": best, "peak_bytes": max(0, peak)}


def interleaved(lengths: list[int], methods: list[str], heads: int, dim: int, repeats: int) -> list[str]:
    """Time ratios in one process, alternating SDPA and each method ``repeats`` times (medians):
    less exposed to a shared machine's drift than separate processes. Time only, no memory."""
    import statistics

    import torch

    from longreach.attention import kernel
    from longreach.methods import create

    rows = ["| method | n | median time / SDPA (interleaved) |", "|---|---|---|"]
    for n in lengths:
        q, k, v = (torch.randn(1, heads, n, dim) for _ in range(3))
        inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
        sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        for method in methods:
            parts = create(method, training_window=n, **METHODS[method]).parts()
            ours = lambda: kernel.attention(q, k, v, parts, inv_freq)
            ratios = []
            for _ in range(repeats + 1):
                start = time.perf_counter(); sdpa(); base = time.perf_counter() - start
                start = time.perf_counter(); ours(); ratios.append((time.perf_counter() - start) / base)
            rows.append(f"| {method} | {n} | {statistics.median(ratios[1:]):.2f}x |")
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="4096,8192,16384")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--methods", help="comma-separated subset of: " + ", ".join([*METHODS, *DROPS]))
    parser.add_argument("--write", action="store_true", help="also write bench/RESULTS.md")
    parser.add_argument("--interleaved", action="store_true", help="position methods only: ratios in one process, alternating with SDPA")
    parser.add_argument("--one", nargs=2, metavar=("METHOD", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one[0], int(args.one[1]), args.heads, args.dim, args.repeats, args.device)))
        return
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.interleaved:
        interleaved(lengths, args.methods.split(",") if args.methods else list(METHODS), args.heads, args.dim, args.repeats)
        return
    chosen = args.methods.split(",") if args.methods else [*METHODS, *DROPS]
    unknown = sorted(set(chosen) - set(METHODS) - set(DROPS))
    if unknown:
        parser.error(f"--methods: unknown {', '.join(unknown)}; choose from {', '.join([*METHODS, *DROPS])}")
    rows = [
        f"Attention only, fp32, batch 1, {args.heads} heads, head dim {args.dim}, device {args.device} "
        f"({platform.processor() or platform.machine()}, {os.cpu_count()} cores); best of {args.repeats}; "
        "peak = growth of peak memory over the inputs. drop: DA at rate 0.3 on every row; dynamic_drop: DDA "
        "(0.15, +0.05 per 1000 tokens, max 0.3) with L = n/2.",
        "",
        "| method | n | time (s) | time / SDPA | peak memory (MiB) | SDPA peak (MiB) |",
        "|---|---|---|---|---|---|",
    ]
    print("\n".join(rows), flush=True)
    for n in lengths:
        results = {}
        for method in ["sdpa", *chosen]:
            command = [sys.executable, __file__, "--one", method, str(n), "--heads", str(args.heads), "--dim", str(args.dim),
                       "--repeats", str(args.repeats), "--device", args.device]
            env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
            results[method] = json.loads(subprocess.run(command, capture_output=True, text=True, check=True, env=env).stdout)
        base = results["sdpa"]
        for method in chosen:
            r = results[method]
            row = (f"| {method} | {n} | {r['seconds']:.3f} | {r['seconds'] / base['seconds']:.2f}x | "
                   f"{r['peak_bytes'] / 2**20:.0f} | {base['peak_bytes'] / 2**20:.0f} |")
            rows.append(row)
            print(row, flush=True)
    if args.write:
        Path(__file__).with_name("RESULTS.md").write_text("# Attention benchmark\n\n`python bench/attention.py --write`\n\n" + "\n".join(rows) + "\n")


if __name__ == "__main__":
    main()

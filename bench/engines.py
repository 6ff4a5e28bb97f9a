"""Cases per minute of ``longreach eval`` on each engine, in the same run (``make test-vllm``'s environment).

    .venv-vllm/bin/python bench/engines.py [--tasks ruler:niah_single_1,ruler:niah_multikey_1,ruler:vt,ruler:fwe]
        [--length 4k] [--samples 16] [--batches 1,4,8] [--method rope] [--write]

One RULER grid (4 tasks x 16 samples = 64 cases at 4K by default) on the default model (SmolLM2-135M-Instruct,
float32), each engine into a fresh folder: the transformers engine at each ``--batches`` size, then vLLM's offline
engine with every case submitted at once. Cases per minute: the cases over the sum of their records' ``seconds``
(building the case and decoding it), so neither the model's load nor the engine's start counts; the answers of every
run are compared with the transformers engine's at batch 1. ``VLLM_CPU_KVCACHE_SPACE`` (GiB of vLLM's CPU cache)
defaults to 4 here.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", default="ruler:niah_single_1,ruler:niah_multikey_1,ruler:vt,ruler:fwe")
    parser.add_argument("--length", default="4k")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--batches", default="1,4,8", help="the transformers engine's batch sizes")
    parser.add_argument("--method", default="rope")
    parser.add_argument("--write", action="store_true", help="write the table into bench/RESULTS.md")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{os.cpu_count() - 1}")  # every core to the engine
    from longreach.eval import runner
    from longreach.eval.engines.transformers import Transformers
    from longreach.eval.engines.vllm import Vllm
    from longreach.methods.spec import MethodSpec

    grid = runner.Grid(
        "default", args.tasks.split(","), [MethodSpec.parse(args.method)], runner.parse_lengths(args.length),
        [0.5], args.samples, None, "float32",
    )  # fmt: skip
    runs = {}
    with tempfile.TemporaryDirectory() as folder:
        for batch in map(int, args.batches.split(",")):
            out = Path(folder) / f"transformers-{batch}"
            runs[f"transformers, batch {batch}"] = runner.read_results(
                runner.run(grid, out, Transformers(), batch_size=batch)
            )
            print(row(f"transformers, batch {batch}", runs), flush=True)
        out = Path(folder) / "vllm"
        runs["vllm"] = runner.read_results(runner.run(grid, out, Vllm(), batch_size=len(grid)))
        print(row("vllm", runs), flush=True)
    best = max((name for name in runs if name.startswith("transformers")), key=lambda name: per_minute(runs[name]))
    lines = [
        "| engine | cases | cases / minute | / transformers' best | answers equal to batch 1's |",
        "|---|---|---|---|---|",
    ]
    lines += [row(name, runs, per_minute(runs[best])) for name in runs]
    table = "\n".join(lines)
    print(table)
    if args.write:
        import torch
        import vllm
        from results import machine, write_section

        command = (
            f"`.venv-vllm/bin/python bench/engines.py --tasks {args.tasks} --length {args.length} --samples "
            f"{args.samples} --batches {args.batches} --method {args.method}`"
        )
        header = (
            f"The default model (SmolLM2-135M-Instruct), float32, {len(grid)} cases at {args.length}, method "
            f"{args.method}; vLLM {vllm.__version__} (every case submitted at once, "
            f"VLLM_CPU_KVCACHE_SPACE={os.environ['VLLM_CPU_KVCACHE_SPACE']} GiB); {machine('cpu')}, "
            f"{torch.get_num_threads()} threads."
        )
        write_section(
            f"Engines, cases per minute, {len(grid)} RULER cases at {args.length}", f"{command}\n\n{header}\n\n{table}"
        )


def per_minute(records: list[dict]) -> float:
    return 60 * len(records) / sum(r["seconds"] for r in records)


def row(name: str, runs: dict, best: float | None = None) -> str:
    """One engine's line: its cases, their rate, against the best transformers rate, and how many answers equal the
    transformers engine's at batch 1 (the first run)."""
    records, first = runs[name], next(iter(runs.values()))
    reference = {(r["task"], r["seed"]): r.get("answer") for r in first}
    equal = sum(reference[r["task"], r["seed"]] == r.get("answer") for r in records)
    rate = per_minute(records)
    ratio = f"{rate / best:.2f}x" if best else ""
    return f"| {name} | {len(records)} | {rate:.1f} | {ratio} | {equal} / {len(records)} |"


if __name__ == "__main__":
    main()

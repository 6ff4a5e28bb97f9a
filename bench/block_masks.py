"""Time to build a method's FlexAttention block masks (every part, one sequence, unpadded), on this machine.

    python bench/block_masks.py [--lengths 8192,32768] [--methods string,dca] [--write]

Once per forward pass since the memo (every layer reuses them); before, DCA's were built per layer.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from results import machine, write_section

from longreach.attention import flex
from longreach.methods import create


def build_time(method: str, n: int, rounds: int = 3) -> float:
    """Median seconds to build every part's block mask at ``n`` tokens, ``L = n / 2`` (each method's defaults)."""
    positions = torch.arange(n)[None]
    parts = create(method, training_window=n // 2).parts()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for part in parts:
            span = None if part.key_span is None else (*part.key_span(positions), positions)
            flex.Region(part.min_distance, part.max_distance, 0, None, span).block_mask(1, n, n, "cpu")
            flex._structured_block_mask.cache_clear()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="8192,32768")
    parser.add_argument("--methods", default="string,dca")
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    rows = ["| method | n | parts | build (ms) |", "|---|---|---|---|"]
    for n in [int(x) for x in args.lengths.split(",")]:
        for method in args.methods.split(","):
            parts = len(create(method, training_window=n // 2).parts())
            rows.append(f"| {method} | {n} | {parts} | {build_time(method, n) * 1e3:.1f} |")
            print(rows[-1], flush=True)
    if args.write:
        write_section(
            f"FlexAttention block masks, build time, n = {args.lengths}",
            f"`python bench/block_masks.py --lengths {args.lengths} --methods {args.methods}`\n\n{machine('cpu')}; "
            "tile arithmetic (before it, a per-pair scan: 8K string 1,061 ms, dca 1,712 ms; 32K string 15.5 s, "
            "dca 30.1 s).\n\n" + "\n".join(rows),
        )


if __name__ == "__main__":
    main()

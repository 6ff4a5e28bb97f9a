"""The evaluation runner's decoding of a left-padded batch, by how many tokens a prefill forward reads.

    python bench/prefill.py [--length 4096] [--batch 4] [--tokens 0,4096,8192] [--rounds 2] [--method rope] [--write]

One process, the default model. ``--batch`` prompts of about ``--length`` tokens (cut from the bundled
essays, 8 tokens shorter each, so the batch is left-padded like the runner's) are answered with
:func:`longreach.eval.generate.greedy` (16 new tokens) under each prefill budget of ``--tokens`` in turn
(``0``: transformers' default, the whole prompts in one forward; ``N``: chunks of ``N // batch`` tokens
per sequence), interleaved, ``--rounds`` times; medians per case and the ratio against ``0`` measured in
the same run. Every budget must give the answers of ``0``.
"""

from __future__ import annotations

import argparse
import functools
import statistics

import torch
from results import machine, timed, write_section

import longreach
from longreach import models
from longreach.eval import generate, haystack, on_model
from longreach.methods.spec import MethodSpec


def prompts(tokenizer, length: int, batch: int) -> list[str]:
    ids = tokenizer(haystack.essays(), add_special_tokens=False)["input_ids"]
    return [tokenizer.decode(ids[97 * i : 97 * i + length - 8 * i]) + " The answer is" for i in range(batch)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", default="0,4096,8192", help="prefill budgets to compare, the first is the baseline")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--method", default="rope")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument(
        "--write", action="store_true", help="also write the table into its section of bench/RESULTS.md"
    )
    args = parser.parse_args()
    budgets = [int(t) for t in args.tokens.split(",")]
    model, tokenizer = models.load("default", dtype=getattr(torch, args.dtype), device=args.device)
    on_model.apply(model, MethodSpec.parse(args.method), longreach.training_window(model.config))
    batch = prompts(tokenizer, args.length, args.batch)
    header = (
        f"SmolLM2-135M-Instruct, {args.dtype}, {args.method}, {args.batch} prompts of "
        f"{args.length - 8 * (args.batch - 1)}-{args.length} tokens left-padded, 16 new tokens, "
        f"{machine(args.device)}; medians of {args.rounds} interleaved rounds."
    )
    print(header, flush=True)
    seconds, answers = {b: [] for b in budgets}, {}

    def run(budget: int) -> None:
        answers.setdefault(budget, []).append(generate.greedy(model, tokenizer, batch, 16, budget))

    for _ in range(args.rounds):
        for budget in budgets:
            seconds[budget].append(timed(functools.partial(run, budget), args.device) / args.batch)
            print(f"budget {budget}: {seconds[budget][-1]:.1f} s per case", flush=True)
    base = statistics.median(seconds[budgets[0]])
    lines = [
        "| tokens per prefill forward | chunk per sequence | s per case | / first | answers as the first |",
        "|---|---|---|---|---|",
    ]
    for budget in budgets:
        median = statistics.median(seconds[budget])
        chunk = generate.prefill_chunk(args.length, args.batch, budget) or "whole prompt"
        same = all(a == answers[budgets[0]][0] for a in answers[budget])
        lines.append(
            f"| {budget or 'no limit'} | {chunk} | {median:.1f} | {median / base:.2f}x | {'yes' if same else 'NO'} |"
        )
    print("\n".join(lines), flush=True)
    if args.write:
        command = (
            f"`python bench/prefill.py --length {args.length} --batch {args.batch} --tokens {args.tokens} "
            f"--rounds {args.rounds}"
            f" --method {args.method}"
            + (f" --device {args.device} --dtype {args.dtype}`" if args.device != "cpu" else "`")
        )
        title = (
            f"Chunked prefill, the runner's decoding, {args.batch} x {args.length} tokens, {args.device} {args.dtype}"
        )
        write_section(title, f"{command}\n\n{header}\n\n" + "\n".join(lines))


if __name__ == "__main__":
    main()

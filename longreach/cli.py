"""The ``longreach`` command."""

from __future__ import annotations

import argparse
import random
import sys
import time


def _demo(args: argparse.Namespace) -> None:
    from tqdm import tqdm

    import longreach
    from longreach import models
    from longreach.eval import generate, haystack

    rng = random.Random(args.seed)
    number = rng.randint(1_000_000, 9_999_999)
    needle = f"One of the special magic numbers for the long river is: {number}."
    question = "What is the special magic number for the long river mentioned in the provided text?"
    template = lambda context: haystack.chat_prompt(
        tokenizer,
        "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
        f"I will quiz you about the numbers afterwards.\n{context}\n{question}",
        "The special magic number for the long river mentioned in the provided text is",
    )
    steps = tqdm(total=1 + len(args.method), desc="loading model", unit="step")
    start = time.perf_counter()
    model, tokenizer = models.load(args.model)
    print(f"loaded {args.model} in {time.perf_counter() - start:.1f} s (training window {longreach.training_window(model.config)})")
    steps.update()
    prompt, n_tokens = haystack.fit(tokenizer, args.length, template, [(args.depth, needle)])
    print(f"needle {number} at depth {args.depth:.0%} of a {n_tokens}-token prompt")
    for method in args.method:
        steps.set_description(f"asking with {method}")
        longreach.apply(model, method)
        start = time.perf_counter()
        (answer,) = generate.greedy(model, tokenizer, [prompt], max_new_tokens=12)
        found = str(number) in answer
        tqdm.write(f"{method:>8}: {answer!r}  [{'found' if found else 'missed'}, {time.perf_counter() - start:.1f} s]")
        steps.update()
    steps.close()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="longreach", description="Measure and extend the context RoPE models really use.")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="one needle question at ~7K tokens on the default model, with rope and string")
    demo.add_argument("--model", default="default", help="'default' (bundled SmolLM2-135M), a local path or a HF id")
    demo.add_argument("--length", type=int, default=7000, help="prompt length in tokens (default 7000)")
    demo.add_argument("--depth", type=float, default=0.1, help="needle depth, 0 = start, 1 = end (default 0.1)")
    demo.add_argument("--method", action="append", help="methods to compare (default: rope, string)")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(run=_demo)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if getattr(args, "method", "unset") is None:
        args.method = ["rope", "string"]
    try:
        args.run(args)
    except (ValueError, RuntimeError) as error:
        sys.exit(f"longreach: error: {error}")


if __name__ == "__main__":
    main()

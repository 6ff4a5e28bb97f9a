"""How long ``ruler:*`` prompts are at a nominal length, over random streams (docs/measuring.md, "How big each
haystack is").

    python bench/ruler_sizes.py [--tasks qa_1,niah_multikey_1,fwe] [--length 4096] [--streams 6] [--cases 20]

RULER's size search runs once per task and length on one random sample, and every case backs off from the
size it finds, so how long a task's cases are is one draw. Stream ``k`` renames every random stream of the
tasks (``ruler:<task>#k/...``; stream 0 is the one ``longreach eval`` uses): a new search and new cases.
Per task and stream: the searched size and the mean, min and max prompt tokens over the cases (generation
not counted), with the default model's tokenizer.
"""

from __future__ import annotations

import argparse
import statistics

from transformers import AutoTokenizer

from longreach import models
from longreach.eval import haystack, ruler


def measure(tokenizer, task: str, length: int, stream: int, cases: int) -> tuple[int, list[int]]:
    """The searched size and every case's prompt tokens of ``task`` at ``length`` in stream ``stream``."""
    named = ruler.common.stream_name
    renamed = (lambda t: f"{named(t)}#{stream}") if stream else named
    for module in (ruler.niah, ruler.qa, ruler.variables, ruler.words):
        module.stream_name = renamed
    haystack._SEARCHED.clear()
    try:
        built = [ruler.TASKS[task].build(tokenizer, length, None, seed) for seed in range(cases)]
    finally:
        for module in (ruler.niah, ruler.qa, ruler.variables, ruler.words):
            module.stream_name = named
    return built[0].searched_units, [case.n_tokens for case in built]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", default="qa_1,niah_multikey_1,fwe")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--streams", type=int, default=6)
    parser.add_argument("--cases", type=int, default=20)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(models.default_path())
    print(f"| task | stream | searched | mean tokens | min | max |  ({args.cases} cases, {args.length} tokens)")
    for task in args.tasks.split(","):
        means = []
        for stream in range(args.streams):
            searched, tokens = measure(tokenizer, task, args.length, stream, args.cases)
            means.append(statistics.mean(tokens))
            print(f"| {task} | {stream} | {searched} | {means[-1]:,.0f} | {min(tokens):,} | {max(tokens):,} |")
        print(f"| {task} | all | | {min(means):,.0f} - {max(means):,.0f} | | |")


if __name__ == "__main__":
    main()

"""``longreach eval`` (a task over methods x lengths x depths x seeds, resumable) and ``longreach report`` (a results
folder's summary, rebuilt)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..eval.records import DTYPES
from . import flags
from .arguments import positive, prefill_tokens, writable_folder

EVAL_SAMPLES = 100  # a pass rate's 95% interval is then at most +-10 points (Wilson, p = 0.5)


def add(subcommands) -> None:
    evaluating = subcommands.add_parser("eval", help="run a task over methods x lengths x depths x seeds (resumable)")
    evaluating.add_argument(
        "task",
        nargs="+",
        help="niah4, niah4-chat, passkey, passkey-chat, niah, ppl, ruler (all 13), or ruler:<name>, e.g. ruler:vt",
    )
    flags.methods(
        evaluating,
        help="method[:param=value,...], repeatable (default: rope and string), e.g. string:shift=2048, "
        "dca:protocol=paper, yarn:factor=2; see `longreach methods`",
    )
    evaluating.add_argument("--lengths", default="2k,4k,8k", help="context lengths, k = 1024 (default 2k,4k,8k)")
    evaluating.add_argument(
        "--depths",
        type=positive,
        default=5,
        help="grid depths from 0 to 1 for the niah heatmap task; its cases cycle through them (default 5)",
    )
    evaluating.add_argument(
        "--dtype",
        choices=DTYPES,
        default="auto",
        help="weights and activations: auto is the checkpoint's own (float32 for the default "
        "model; bfloat16 for most published ones, as upstream runs them)",
    )
    _grid_options(evaluating, "runs/eval", EVAL_SAMPLES)
    evaluating.set_defaults(run=evaluate)

    reporting = subcommands.add_parser(
        "report",
        help="rebuild summary.md, summary.csv, summary.json and the pictures of a "
        "results folder from its results.jsonl",
    )
    reporting.add_argument("dir", metavar="DIR", help="a results folder (holding results.jsonl)")
    flags.score_threshold(reporting)
    reporting.set_defaults(run=report)


def _grid_options(p: argparse.ArgumentParser, out: str, samples: int) -> None:
    """The model, cases, batching, the results folder."""
    flags.model(p)
    p.add_argument(
        "--samples",
        "--seeds",
        type=positive,
        default=samples,
        help=f"cases per (task, length, method) (default {samples}; RULER uses 500)",
    )
    flags.batch_size(p, help="cases decoded together, left-padded (default 1)")
    p.add_argument(
        "--prefill-tokens",
        type=prefill_tokens,
        default=None,
        metavar="N|auto",
        help="read the prompts in chunks of at most N tokens over the batch (0: in one forward; default "
        "auto: 4096 for a batch, one forward for one case)",
    )
    p.add_argument("--out", default=out, help=f"results folder; a rerun resumes it (default {out})")
    p.add_argument("--limit", type=positive, help="run at most this many new cases (per process under torchrun)")
    p.add_argument(
        "--tp",
        action="store_true",
        help="under torchrun: shard the model over the processes (tensor parallelism) instead of sharing out the cases",
    )
    flags.training_window(p)
    flags.score_threshold(p)


def _grid(args: argparse.Namespace):
    from ..eval import runner

    tasks = flags.task_registry()
    names = [name for task in args.task for name in tasks.expand(task)]
    if any(t == "ruler" for t in args.task) and (reason := tasks.qa_available()):
        print(reason)
    return runner.Grid(
        args.model,
        names,
        flags.method_specs(args),
        runner.parse_lengths(args.lengths),
        runner.depth_grid(args.depths),
        args.samples,
        args.training_window,
        args.dtype,
    )


def evaluate(args: argparse.Namespace) -> None:
    from ..eval import runner
    from ..eval.distributed import World

    grid = _grid(args)  # every argument checked before anything is written
    out = writable_folder(args.out)
    runner.run(
        grid,
        out,
        limit=args.limit,
        batch_size=args.batch_size,
        tp=args.tp,
        prefill_tokens=args.prefill_tokens,
        command=args.command_line,
    )
    if World.from_environment(args.tp).rank:  # under torchrun, process 0 reports
        return
    summarize(out, args.threshold)


def report(args: argparse.Namespace) -> None:
    if not Path(args.dir).is_dir():
        raise ValueError(f"{args.dir} is not a results folder")
    summarize(Path(args.dir), args.threshold)


def summarize(out: Path, threshold: float) -> None:
    """Write the folder's report files; print its tables as plain text and where the rest is."""
    from ..eval import plain_text, report

    report.build(out, threshold)
    print(plain_text.tables(json.loads((out / "summary.json").read_text(encoding="utf-8"))))
    print(f"\nsummary.md (every table, with the pictures), summary.csv, summary.json and results.jsonl in {out}/")

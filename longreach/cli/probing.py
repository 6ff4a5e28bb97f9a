"""``longreach probe``: train, measure and report the probing experiment (see :mod:`longreach.probe`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..probe.experiment import SAVE_EVERY, STEPS
from . import flags
from .arguments import positive, writable_folder


def add(commands) -> None:
    """``probe train``, ``probe measure``, ``probe report`` and ``probe experiment``."""
    probing = commands.add_parser(
        "probe",
        help="the STRING paper's probing experiment in miniature: train small RoPE models on "
        "a synthetic corpus, measure effective length by distance, report (resumable)",
    )
    actions = probing.add_subparsers(dest="action", required=True)
    training = actions.add_parser(
        "train", help="train a small Llama on documents of a chosen length distribution (CPU)"
    )
    training.add_argument("--window", type=positive, default=256, help="the training window L in tokens (default 256)")
    training.add_argument(
        "--distribution",
        choices=("natural", "uniform", "concat"),
        default="natural",
        help="document lengths: natural (log-normal, one per row), uniform, concat (packed) (default natural)",
    )
    training.add_argument(
        "--median-tokens",
        type=positive,
        default=32,
        help="the log-normal's median document length in tokens, natural and concat (default 32, "
        "the same documents whatever the window)",
    )
    training.add_argument("--steps", type=positive, default=2000, help="optimizer steps (default 2000)")
    training.add_argument("--rows", type=positive, default=16, help="windows per step (default 16)")
    training.add_argument("--save-every", type=positive, default=250, help="checkpoint every N steps (default 250)")
    training.add_argument("--layers", type=positive, default=2, help="decoder layers (default 2)")
    training.add_argument("--hidden", type=positive, default=128, help="hidden size (default 128)")
    training.add_argument("--heads", type=positive, default=4, help="attention heads (default 4)")
    training.add_argument("--kv-heads", type=positive, default=2, help="key/value heads (default 2)")
    training.add_argument(
        "--rope-theta", type=float, default=80.0, help="RoPE's base (default 80: see longreach.probe.train.Shape)"
    )
    training.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (default 2e-3)")
    training.add_argument(
        "--seed", type=int, default=0, help="random seed of the initial weights and of the batches drawn (default 0)"
    )
    training.add_argument("--out", help="run folder; a rerun resumes it (default runs/probe/DISTRIBUTION_WINDOW)")
    training.set_defaults(run=_train)
    measuring = actions.add_parser(
        "measure", help="retrieval accuracy by distance of every checkpoint of a run, per method"
    )
    measuring.add_argument("folder", metavar="RUN", help="a folder written by `longreach probe train`")
    flags.methods(measuring)
    measuring.add_argument("--cases", type=positive, default=100, help="cases per distance and method (default 100)")
    measuring.add_argument(
        "--distances", type=positive, default=16, help="distances tested, evenly spread (default 16)"
    )
    measuring.add_argument("--final-only", action="store_true", help="the last checkpoint only (default: every one)")
    measuring.set_defaults(run=_measure)
    reporting = actions.add_parser(
        "report", help="effective length vs tokens seen and vs position frequency; accuracy by distance"
    )
    reporting.add_argument("folders", nargs="+", metavar="RUN", help="measured run folders")
    reporting.add_argument("--out", default="runs/probe/report", help="report folder (default runs/probe/report)")
    flags.score_threshold(
        reporting, help="the accuracy an effective length must reach at every distance up to it (default RULER's 85.6)"
    )
    reporting.set_defaults(run=_report)
    whole = actions.add_parser(
        "experiment",
        help="the whole experiment (make probing): four runs trained in parallel, measured, reported (resumable)",
    )
    whole.add_argument("--out", default="runs/probe", help="where the runs go (default runs/probe)")
    whole.add_argument("--report", default="docs/probing", help="where the report goes (default docs/probing)")
    whole.add_argument("--steps", type=positive, default=STEPS, help=f"optimizer steps per run (default {STEPS})")
    whole.add_argument(
        "--save-every",
        type=positive,
        default=SAVE_EVERY,
        help=f"checkpoint (and measure) every N steps (default {SAVE_EVERY})",
    )
    whole.add_argument("--cases", type=positive, default=100, help="cases per distance and method (default 100)")
    whole.add_argument("--workers", type=positive, help="processes in parallel (default: one per core, at most 4)")
    whole.set_defaults(run=_experiment)


def _train(args: argparse.Namespace) -> None:
    from ..probe import corpus, train

    if args.median_tokens > args.window:
        raise ValueError(f"--median-tokens {args.median_tokens} is out of range: at most the window ({args.window})")
    data = corpus.Corpus(args.window, args.distribution, median=args.median_tokens / args.window)
    shape = train.Shape(args.layers, args.hidden, args.heads, args.kv_heads, args.rope_theta)
    schedule = train.Schedule(args.steps, args.rows, args.lr, min(100, args.steps // 10), args.save_every, args.seed)
    out = writable_folder(args.out or f"runs/probe/{args.distribution}_{args.window}")
    print(f"last checkpoint: {train.train(data, out, shape, schedule)}")


def _measure(args: argparse.Namespace) -> None:
    from ..probe import measure

    flags.method_specs(args)  # a malformed one fails before any measuring
    methods = args.method or flags.DEFAULT_METHODS
    measure.measure_run(Path(args.folder), methods, args.cases, args.distances, final_only=args.final_only)
    print(f"{Path(args.folder) / measure.RESULTS} holds {', '.join(methods)} at every checkpoint")


def _report(args: argparse.Namespace) -> None:
    from ..probe import report

    out = writable_folder(args.out)
    summary = report.build([Path(run) for run in args.folders], out, args.threshold)
    print((out / "summary.md").read_text(encoding="utf-8"))
    print(f"summary.md, summary.json, effective_length.png and {len(summary['runs'])} accuracy_RUN.png in {out}/")


def _experiment(args: argparse.Namespace) -> None:
    from ..probe import experiment

    report = writable_folder(args.report, "--report")
    experiment.main(writable_folder(args.out), report, args.steps, args.save_every, args.cases, args.workers)
    print((report / "summary.md").read_text(encoding="utf-8"))

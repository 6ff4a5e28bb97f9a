"""``longreach tune`` (a grid of a method's parameters on a task at one length) and ``longreach calibrate`` (DPE's pair
importance and group-scale search), both resumable."""

from __future__ import annotations

import argparse

from . import flags
from .arguments import positive, writable_folder


def add(subcommands) -> None:
    tuning = subcommands.add_parser(
        "tune",
        help="a grid of a method's parameters on a task at one length: scores with "
        "intervals, the best as an apply(...) line (resumable)",
    )
    tuning.add_argument("method", help="a position method, e.g. string, self_extend, dca, dpe")
    tuning.add_argument(
        "--grid",
        nargs="+",
        required=True,
        help="name=value1,value2 per parameter, e.g. shift=1024,2048 local_window=64,128",
    )
    tuning.add_argument("--set", help="parameters held fixed, name=value,... (lists with ;), e.g. local_window=128")
    tuning.add_argument("--task", default="passkey", help="any longreach task (default passkey)")
    tuning.add_argument("--length", default="8k", help="the one context length to tune at, k = 1024 (default 8k)")
    tuning.add_argument("--no-baseline", action="store_true", help="leave out the rope row run on the same cases")
    flags.model(tuning)
    tuning.add_argument("--samples", type=positive, default=20, help="cases per setting (default 20)")
    flags.batch_size(tuning)
    tuning.add_argument("--limit", type=positive, help="run at most this many new cases")
    flags.training_window(tuning)
    tuning.add_argument("--out", help="results folder; a rerun resumes it (default runs/tune_METHOD)")
    tuning.set_defaults(run=tune)

    calibration = subcommands.add_parser(
        "calibrate", help="DPE's pair importance and group-scale search on a model (resumable)"
    )
    calibration.add_argument("method", help="the method to calibrate: dpe")
    flags.model(calibration)
    calibration.add_argument(
        "--length", default="8k", help="the target length the scales are searched for (default 8k)"
    )
    calibration.add_argument("--samples", type=positive, default=10, help="probe cases per setting (default 10)")
    calibration.add_argument(
        "--importance-samples",
        type=positive,
        default=10,
        help="texts per length for pair importance (default 10, as DPE)",
    )
    calibration.add_argument("--local-window", type=positive, default=1024, help="DPE's w in tokens (default 1024)")
    calibration.add_argument(
        "--top-k",
        type=int,
        help="pairs changed per head (default: 3/4 of the rotary pairs, the "
        "paper's 48 of 64; 0: every pair, no importance measurement)",
    )
    calibration.add_argument("--groups", type=positive, default=8, help="frequency groups (default 8)")
    calibration.add_argument(
        "--task",
        default="ruler-tight:niah_multivalue",
        help="the probe (default ruler-tight:niah_multivalue: 4 values, fraction found, the length filled)",
    )
    flags.batch_size(calibration)
    flags.training_window(calibration)
    calibration.add_argument("--out", help="results folder; a rerun resumes it (default runs/calibrate_dpe_LENGTH)")
    calibration.set_defaults(run=calibrate)


def tune(args: argparse.Namespace) -> None:
    from ..methods import METHODS
    from ..methods.spec import MethodSpec
    from ..tuning import tune

    if args.method not in METHODS:
        raise ValueError(f"tune takes a position method ({', '.join(METHODS)}), got {args.method!r}")
    flags.task_registry().get(args.task)
    grid = tune.parse_grid(args.grid)
    fixed = dict(MethodSpec.parse(f"{args.method}:{args.set}").params) if args.set else {}
    length = flags.single_length(args.length)
    out = writable_folder(args.out or f"runs/tune_{args.method}")
    _, winner, text = tune.run(
        args.model,
        args.method,
        grid,
        args.task,
        length,
        args.samples,
        out,
        fixed,
        None if args.no_baseline else "rope",
        args.training_window,
        args.batch_size,
        args.limit,
    )
    print(text)
    print(f"tune_{args.method}.md, .json and .png in {out}/")


def calibrate(args: argparse.Namespace) -> None:
    from ..tuning import calibrate

    if args.method != "dpe":
        raise ValueError(
            f"calibrate measures DPE's settings; got {args.method!r} (use `longreach tune` for other methods)"
        )
    flags.task_registry().get(args.task)
    length = flags.single_length(args.length)  # before the default folder's name is made of it
    out = writable_folder(args.out or f"runs/calibrate_dpe_{args.length}").resolve()
    result = calibrate.calibrate(
        args.model,
        length,
        out,
        args.samples,
        args.local_window,
        args.top_k,
        args.importance_samples,
        args.task,
        args.groups,
        args.training_window,
        args.batch_size,
    )
    print((out / "calibration.md").read_text(encoding="utf-8"))
    print(
        f"use: {result['apply']}\ncalibration.md, calibration.json, calibration.png and dimensions.safetensors in "
        f"{out}/"
    )

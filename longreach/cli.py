"""The ``longreach`` command: ``eval``, ``report`` and ``demo``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DEMO_LENGTHS = "2k,4k,6k,8k"


def _grid(args: argparse.Namespace):
    from .eval import runner, tasks

    names = [name for task in args.task for name in tasks.expand(task)]
    if any(t == "ruler" for t in args.task) and (reason := tasks.qa_available()):
        print(reason)
    methods = [runner.MethodSpec.parse(m) for m in (args.method or ["rope", "string"])]
    return runner.Grid(args.model, names, methods, runner.parse_lengths(args.lengths),
                       runner.depth_grid(args.depths), args.seeds)


def _eval(args: argparse.Namespace) -> None:
    from .eval import report, runner

    out = Path(args.out)
    runner.run(_grid(args), out, limit=args.limit)
    print(report.build(out, args.threshold))
    print(f"results, summary.md and pictures in {out}/")


def _report(args: argparse.Namespace) -> None:
    from .eval import report

    print(report.build(Path(args.dir), args.threshold))


def _dispersion(args: argparse.Namespace) -> None:
    import longreach

    from . import models
    from .analysis import dispersion
    from .eval import haystack, runner

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = Path(args.text).read_text(encoding="utf-8") if args.text else haystack.essays()
    (length,) = runner.parse_lengths(args.length)
    model, tokenizer = models.load(args.model)
    window = longreach.training_window(model.config)
    results = {}
    for spec in [runner.MethodSpec.parse(m) for m in (args.method or ["rope", "dynamic_drop"])]:
        method, kwargs = spec.arguments(window)
        longreach.apply(model, method, **kwargs)
        print(f"probing {spec.label} at {length} tokens ...", flush=True)
        results[spec.label] = dispersion.measure(model, tokenizer, text, length, args.points, args.top_k)
    longreach.remove(model)
    print(f"wrote {dispersion.save(results, out / 'dispersion.json')} and {dispersion.plot(results, out / 'dispersion.png', window)}")


def _methods(args: argparse.Namespace) -> None:
    from .methods import available

    print("| method | kind | paper | what it changes | parameters (default; range) |")
    print("|---|---|---|---|---|")
    for row in available():
        params = "; ".join(f"`{k}`={v!r} ({row['ranges'].get(k, '')})" for k, v in row["parameters"].items()) or "—"
        print(f"| `{row['name']}` | {row['kind']} | {row['paper']} | {row['changes']} | {params} |")
    print("\nAny method also takes protocol=paper on the command line: the STRING paper's baseline set-up "
          "(as if the window were 2L/3, factor 3/2).")


def _demo(args: argparse.Namespace) -> None:
    args.task, args.method, args.lengths, args.depths = ["niah4"], ["rope", "string"], DEMO_LENGTHS, 1
    _eval(args)


def build_parser() -> argparse.ArgumentParser:
    from .eval.report import RULER_THRESHOLD

    parser = argparse.ArgumentParser(prog="longreach", description="Measure and extend the context RoPE models really use.")
    commands = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser, out: str, seeds: int) -> None:
        p.add_argument("--model", default="default", help="'default' (bundled SmolLM2-135M-Instruct), a local path or a HF id")
        p.add_argument("--seeds", type=int, default=seeds, help=f"cases per (length, depth) cell (default {seeds})")
        p.add_argument("--out", default=out, help=f"results folder; a rerun resumes it (default {out})")
        p.add_argument("--limit", type=int, help="run at most this many new cases")
        p.add_argument("--threshold", type=float, default=RULER_THRESHOLD, help="effective-length threshold (RULER: 85.6)")

    evaluate = commands.add_parser("eval", help="run a task over methods x lengths x depths x seeds (resumable)")
    evaluate.add_argument("task", nargs="+", help="niah, niah4, passkey, ppl, ruler (all), or ruler:<name>, e.g. ruler:vt")
    evaluate.add_argument("--method", action="append",
                          help="method[:param=value,...], repeatable (default: rope and string), e.g. string:shift=2048, "
                          "dca:protocol=paper, yarn:factor=2; see `longreach methods`")
    evaluate.add_argument("--lengths", default="2k,4k,8k", help="context lengths, k = 1024 (default 2k,4k,8k)")
    evaluate.add_argument("--depths", type=int, default=5, help="needle depths from 0 to 1, for depth tasks (default 5)")
    common(evaluate, "runs/eval", 3)
    evaluate.set_defaults(run=_eval)

    probe = commands.add_parser("dispersion", help="top-k attention probability vs position, per layer, per method")
    probe.add_argument("--model", default="default", help="'default', a local path or a HF id")
    probe.add_argument("--text", help="a text file (default: the Paul Graham essays)")
    probe.add_argument("--length", default="12k", help="tokens of text to read (default 12k)")
    probe.add_argument("--method", action="append", help="methods to compare (default: rope and dynamic_drop)")
    probe.add_argument("--points", type=int, default=24, help="query positions sampled evenly (default 24)")
    probe.add_argument("--top-k", type=int, default=1, help="mean of the k largest probabilities (default 1: the max)")
    probe.add_argument("--out", default="runs/dispersion", help="folder for dispersion.json and dispersion.png")
    probe.set_defaults(run=_dispersion)

    listing = commands.add_parser("methods", help="every method: paper, what it changes, parameters with defaults and ranges")
    listing.set_defaults(run=_methods)

    report = commands.add_parser("report", help="rebuild summary.md and the pictures of a results folder from its JSONL")
    report.add_argument("dir")
    report.add_argument("--threshold", type=float, default=RULER_THRESHOLD)
    report.set_defaults(run=_report)

    demo = commands.add_parser("demo", help=f"niah4 at {DEMO_LENGTHS} on the default model with rope and string")
    common(demo, "runs/demo", 2)
    demo.set_defaults(run=_demo)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.run(args)
    except (ValueError, RuntimeError) as error:
        sys.exit(f"longreach: error: {error}")
    except KeyboardInterrupt:
        sys.exit("longreach: interrupted; every finished case is saved, rerun the same command to resume")


if __name__ == "__main__":
    main()

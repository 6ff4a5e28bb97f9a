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


def _freq(args: argparse.Namespace) -> None:
    import numpy as np

    from .analysis import frequency

    sources = [x for x in (args.lengths_file, args.texts, args.synthetic) if x]
    if len(sources) != 1:
        raise ValueError("give exactly one of --lengths-file, --texts (with --model) or --synthetic")
    if args.lengths_file:
        lengths, name = np.loadtxt(args.lengths_file, dtype=np.int64, ndmin=1), Path(args.lengths_file).name
    elif args.texts:
        from transformers import AutoTokenizer

        from .models import default_path

        tokenizer = AutoTokenizer.from_pretrained(default_path() if args.model == "default" else args.model)
        lengths, name = frequency.token_lengths(Path(args.texts), tokenizer), args.texts
    else:
        lengths, name = frequency.synthetic(args.synthetic, args.seed), args.synthetic
    print(f"{len(lengths):,} documents, {int(lengths.sum()):,} tokens ({name}); L = {args.window}\n")
    print("| packing | share at i < L/2 | share at i >= 3L/4 |\n|---|---|---|")
    for packing in frequency.PACKINGS:
        s = frequency.shares(frequency.frequency(lengths, args.window, packing))
        print(f"| {packing} | {s['i < L/2']:.1%} | {s['i >= 3L/4']:.1%} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"\nwrote {frequency.plot(lengths, args.window, out, f'position frequency: {name}, L = {args.window}')}")


def _matrix(args: argparse.Namespace) -> None:
    from .analysis import matrix
    from .eval import runner

    spec = runner.MethodSpec.parse(args.method)
    P, description = matrix.matrix(spec.name, args.length, args.window, **dict(spec.params))
    out = Path(args.out or f"matrix_{spec.name}_{args.length}.png")
    if args.length <= 24:
        print("\n".join(" ".join("  ." if v != v else f"{v:3g}" for v in row) for row in P))  # NaN: not attended
    print(f"wrote {matrix.plot(P, f'{description}, L = {args.window or args.length}', out)}")


def _cost(args: argparse.Namespace) -> None:
    from .analysis import cost
    from .eval import runner

    shape = cost.shape_of(cost.load_config(args.model))
    lengths = runner.parse_lengths(args.lengths)
    dtype_bytes = cost.DTYPE_BYTES[args.dtype]
    print(f"{shape.name}: {shape.layers} layers, {shape.heads} heads ({shape.kv_heads} KV), head dim {shape.head_dim}, "
          f"{shape.parameters:,} parameters; {args.dtype}\n")
    print(cost.markdown(cost.table(shape, lengths, dtype_bytes, args.sliding_window), args.sliding_window))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"\nwrote {cost.plot(shape, lengths, out, dtype_bytes, args.sliding_window)}")


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

    freq = commands.add_parser("freq", help="position frequency f(i) under three packings, with shares and a plot")
    freq.add_argument("--window", type=int, default=2048, help="training window L (default 2048, as the paper)")
    freq.add_argument("--lengths-file", help="a text file of document lengths, one per line")
    freq.add_argument("--texts", help="a folder of .txt files, tokenized with --model's tokenizer")
    freq.add_argument("--model", default="default", help="tokenizer for --texts (default: the bundled SmolLM2)")
    freq.add_argument("--synthetic", help="lognormal[:mean=6.5,sigma=1.4,count=100000], exponential[:scale=..], fixed[:length=..]")
    freq.add_argument("--seed", type=int, default=0)
    freq.add_argument("--out", default="runs/frequency.png")
    freq.set_defaults(run=_freq)

    pictures = commands.add_parser("matrix", help="a method's relative-position matrix as a picture")
    pictures.add_argument("method", help="method[:param=value,...], e.g. string:shift=3,local_window=1")
    pictures.add_argument("--length", type=int, default=9, help="matrix size (default 9, the paper's Figure 5)")
    pictures.add_argument("--window", type=int, help="training window L (default: --length)")
    pictures.add_argument("--out", help="PNG path (default matrix_METHOD_LENGTH.png)")
    pictures.set_defaults(run=_matrix)

    costs = commands.add_parser("cost", help="attention FLOPs, KV-cache and weight memory per length, from a config")
    costs.add_argument("--model", default="default", help="'default', a config.json, a local folder or a hub id")
    costs.add_argument("--lengths", default="4k,32k,128k,1024k", help="k = 1024 (default 4k,32k,128k,1024k)")
    costs.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16", "float8"])
    costs.add_argument("--sliding-window", type=int, default=4096)
    costs.add_argument("--out", default="runs/cost.png")
    costs.set_defaults(run=_cost)

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

"""The ``longreach`` command: ``eval``, ``report``, ``demo``, ``tune``, ``calibrate``, ``probe`` and the analyses."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

DEMO_LENGTHS = "2k,4k,6k,8k"
EVAL_SAMPLES = 100  # a pass rate's 95% interval is then at most +-10 points (Wilson, p = 0.5)
DEMO_SAMPLES = 2
MAX_MATRIX = 4096  # matrix pictures are dense length x length arrays


def positive(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is out of range: an integer >= 1")
    return value


def prefill_tokens(text: str) -> int | None:
    """argparse type of --prefill-tokens: an integer >= 0, or 'auto' (``None``)."""
    if text == "auto":
        return None
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is out of range: an integer >= 0 or 'auto'")
    return int(text)


def threshold(text: str) -> float:
    """argparse type of --threshold: a score from 0 to 100."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= value <= 100:  # NaN fails too
        raise argparse.ArgumentTypeError(f"{text} is out of range: a score from 0 to 100 (RULER: 85.6)")
    return value


def writable_folder(path: str, flag: str = "--out") -> Path:
    """``path`` as a folder we can write in (made if missing), or a one-line error naming ``flag``."""
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{flag}={path} is a file, not a folder: give a folder for the results")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):  # a name of its own: several processes may probe one folder at once
            pass
    except OSError as error:
        raise ValueError(f"{flag}={path} is not a writable folder ({error.strerror or error})") from None
    return folder


def writable_file(path: str, flag: str = "--out") -> Path:
    """A picture's path: its folder must be writable and the path itself not a folder; without a suffix it
    gets ``.png`` (what matplotlib would add when saving), so the path printed is the file written."""
    if Path(path).is_dir():
        raise ValueError(f"{flag}={path} is a folder: give a file name such as {Path(path) / 'picture.png'}")
    target = Path(path) if Path(path).suffix else Path(path + ".png")
    writable_folder(str(target.parent), flag)
    return target


def existing_file(path: str, flag: str) -> Path:
    if not Path(path).is_file():
        raise ValueError(f"{flag}={path} does not exist or is not a file")
    return Path(path)


def _grid(args: argparse.Namespace):
    from .eval import runner, tasks

    names = [name for task in args.task for name in tasks.expand(task)]
    if any(t == "ruler" for t in args.task) and (reason := tasks.qa_available()):
        print(reason)
    methods = [runner.MethodSpec.parse(m) for m in (args.method or ["rope", "string"])]
    return runner.Grid(args.model, names, methods, runner.parse_lengths(args.lengths),
                       runner.depth_grid(args.depths), args.samples, args.training_window, getattr(args, "dtype", "auto"))


def _eval(args: argparse.Namespace) -> None:
    from .eval import report, runner
    from .eval.distributed import World

    grid = _grid(args)  # every argument checked before anything is written
    out = writable_folder(args.out)
    runner.run(grid, out, limit=args.limit, batch_size=args.batch_size, tp=args.tp, prefill_tokens=args.prefill_tokens)
    if World.from_environment(args.tp).rank:  # under torchrun, process 0 reports
        return
    print(report.build(out, args.threshold))
    print(f"results, summary.md and pictures in {out}/")


def _report(args: argparse.Namespace) -> None:
    from .eval import report

    if not Path(args.dir).is_dir():
        raise ValueError(f"{args.dir} is not a results folder")
    print(report.build(Path(args.dir), args.threshold))


def _dispersion(args: argparse.Namespace) -> None:
    import longreach

    from . import models
    from .analysis import dispersion
    from .eval import haystack, runner

    text = existing_file(args.text, "--text").read_text(encoding="utf-8") if args.text else haystack.essays()
    lengths = runner.parse_lengths(args.length)
    if len(lengths) != 1:
        raise ValueError(f"--length={args.length} gives {len(lengths)} lengths: give one, e.g. 12k")
    specs = [runner.MethodSpec.parse(m) for m in (args.method or ["rope", "dynamic_drop"])]
    out = writable_folder(args.out)
    runner.check_methods(specs, models.load_config(args.model), args.training_window)
    model, tokenizer = models.load(args.model)
    window = args.training_window or longreach.training_window(model.config)
    runner.check_lengths(lengths, window)
    (length,) = lengths
    results = {}
    for spec in specs:
        spec.apply(model, window)
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
    out = writable_file(args.out)
    if args.lengths_file:
        lengths_file = existing_file(args.lengths_file, "--lengths-file")
        try:
            lengths = np.loadtxt(lengths_file, dtype=np.int64, ndmin=1)
        except ValueError:
            raise ValueError(f"--lengths-file={args.lengths_file} must hold one whole number per line") from None
        name = lengths_file.name
    elif args.texts:
        if not Path(args.texts).is_dir():
            raise ValueError(f"--texts={args.texts} is not a folder of .txt files")
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
    print(f"\nwrote {frequency.plot(lengths, args.window, out, f'position frequency: {name}, L = {args.window}')}")


def _matrix(args: argparse.Namespace) -> None:
    from .analysis import matrix
    from .eval import runner

    spec = runner.MethodSpec.parse(args.method)
    if args.length > MAX_MATRIX:
        raise ValueError(f"--length={args.length} is out of range: 1 .. {MAX_MATRIX} (the matrix is drawn whole)")
    P, description = matrix.matrix(spec.name, args.length, args.window, **dict(spec.params))
    out = writable_file(args.out or f"matrix_{spec.name}_{args.length}.png")
    groups = [P] if P.ndim == 2 else [P[..., g] for g in range(P.shape[-1])]
    titles = [f"frequency group {g} (scale {s})" for g, s in enumerate(dict(spec.params).get("group_scales", ()))] or None
    if args.length <= 24:
        for g, panel in enumerate(groups):
            print(titles[g] if titles and len(groups) > 1 else "", end="\n" if len(groups) > 1 else "")
            print("\n".join(" ".join("  ." if v != v else f"{v:3g}" for v in row) for row in panel))  # NaN: not attended
    print(f"wrote {matrix.plot(P, f'{description}, L = {args.window or args.length}', out, panel_titles=titles)}")


def _cost(args: argparse.Namespace) -> None:
    from .analysis import cost
    from .eval import runner

    shape = cost.shape_of(cost.load_config(args.model))
    lengths = runner.parse_lengths(args.lengths)
    dtype_bytes = cost.DTYPE_BYTES[args.dtype]
    print(f"{shape.name}: {shape.layers} layers, {shape.heads} heads ({shape.kv_heads} KV), head dim {shape.head_dim}, "
          f"{shape.parameters:,} parameters; {args.dtype}\n")
    out = writable_file(args.out)
    print(cost.markdown(cost.table(shape, lengths, dtype_bytes, args.sliding_window), args.sliding_window))
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


def _single_length(text: str) -> int:
    from .eval import runner

    lengths = runner.parse_lengths(text)
    if len(lengths) != 1:
        raise ValueError(f"--length={text} gives {len(lengths)} lengths: give one, e.g. 8k")
    return lengths[0]


def _tune(args: argparse.Namespace) -> None:
    from .eval import runner, tasks, tune
    from .methods import METHODS

    if args.method not in METHODS:
        raise ValueError(f"tune takes a position method ({', '.join(METHODS)}), got {args.method!r}")
    tasks.get(args.task)
    grid = tune.parse_grid(args.grid)
    fixed = dict(runner.MethodSpec.parse(f"{args.method}:{args.set}").params) if args.set else {}
    length = _single_length(args.length)
    out = writable_folder(args.out or f"runs/tune_{args.method}")
    _, winner, text = tune.run(args.model, args.method, grid, args.task, length, args.samples, out, fixed,
                               None if args.no_baseline else "rope", args.training_window, args.batch_size, args.limit)
    print(text)
    print(f"tune_{args.method}.md, .json and .png in {out}/")


def _calibrate(args: argparse.Namespace) -> None:
    from .eval import calibrate, tasks

    if args.method != "dpe":
        raise ValueError(f"calibrate measures DPE's settings; got {args.method!r} (use `longreach tune` for other methods)")
    tasks.get(args.task)
    length = _single_length(args.length)  # before the default folder's name is made of it
    out = writable_folder(args.out or f"runs/calibrate_dpe_{args.length}").resolve()
    result = calibrate.calibrate(args.model, length, out, args.samples, args.local_window, args.top_k,
                                 args.importance_samples, args.task, args.groups, args.training_window, args.batch_size)
    print((out / "calibration.md").read_text(encoding="utf-8"))
    print(f"use: {result['apply']}\ncalibration.md, calibration.json, calibration.png and dimensions.safetensors in {out}/")


def _demo(args: argparse.Namespace) -> None:
    args.task, args.method, args.lengths, args.depths = ["niah4"], ["rope", "string"], DEMO_LENGTHS, 1
    _eval(args)


TRAINING_WINDOW_HELP = "the training window L every default derives from (default: the config's max_position_embeddings)"


def build_parser() -> argparse.ArgumentParser:
    from .eval import runner
    from .eval.report import RULER_THRESHOLD
    from .probe import cli as probe_cli

    parser = argparse.ArgumentParser(prog="longreach", description="Measure and extend the context RoPE models really use.")
    commands = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser, out: str, samples: int) -> None:
        p.add_argument("--model", default="default", help="'default' (bundled SmolLM2-135M-Instruct), a local path or a HF id")
        p.add_argument("--samples", "--seeds", type=positive, default=samples,
                       help=f"cases per (task, length, method) (default {samples}; RULER uses 500)")
        p.add_argument("--batch-size", type=positive, default=1, help="cases decoded together, left-padded (default 1)")
        p.add_argument("--prefill-tokens", type=prefill_tokens, default=None, metavar="N|auto",
                       help="read the prompts in chunks of at most N tokens over the batch (0: in one forward; default "
                            "auto: 4096 for a batch, one forward for one case)")
        p.add_argument("--out", default=out, help=f"results folder; a rerun resumes it (default {out})")
        p.add_argument("--limit", type=positive, help="run at most this many new cases (per process under torchrun)")
        p.add_argument("--tp", action="store_true", help="under torchrun: shard the model over the processes (tensor "
                       "parallelism) instead of sharing out the cases")
        p.add_argument("--training-window", type=positive, help=TRAINING_WINDOW_HELP)
        p.add_argument("--threshold", type=threshold, default=RULER_THRESHOLD, help="effective-length threshold (RULER: 85.6)")

    evaluate = commands.add_parser("eval", help="run a task over methods x lengths x depths x seeds (resumable)")
    evaluate.add_argument("task", nargs="+", help="niah4, niah4-chat, passkey, passkey-chat, niah, ppl, ruler (all 13), "
                          "or ruler:<name>, e.g. ruler:vt")
    evaluate.add_argument("--method", action="append",
                          help="method[:param=value,...], repeatable (default: rope and string), e.g. string:shift=2048, "
                          "dca:protocol=paper, yarn:factor=2; see `longreach methods`")
    evaluate.add_argument("--lengths", default="2k,4k,8k", help="context lengths, k = 1024 (default 2k,4k,8k)")
    evaluate.add_argument("--depths", type=positive, default=5, help="grid depths from 0 to 1 for the niah heatmap task; its "
                          "cases cycle through them (default 5)")
    evaluate.add_argument("--dtype", choices=runner.DTYPES, default="auto",
                          help="weights and activations: auto is the checkpoint's own (float32 for the default model; "
                          "bfloat16 for most published ones, as upstream runs them)")
    common(evaluate, "runs/eval", EVAL_SAMPLES)
    evaluate.set_defaults(run=_eval)

    probe = commands.add_parser("dispersion", help="top-k attention probability vs position, per layer, per method")
    probe.add_argument("--model", default="default", help="'default', a local path or a HF id")
    probe.add_argument("--text", help="a text file (default: the Paul Graham essays)")
    probe.add_argument("--length", default="12k", help="tokens of text to read (default 12k)")
    probe.add_argument("--method", action="append", help="methods to compare (default: rope and dynamic_drop)")
    probe.add_argument("--points", type=positive, default=24, help="query positions sampled evenly (default 24)")
    probe.add_argument("--top-k", type=positive, default=1, help="mean of the k largest probabilities (default 1: the max)")
    probe.add_argument("--training-window", type=positive, help=TRAINING_WINDOW_HELP)
    probe.add_argument("--out", default="runs/dispersion", help="folder for dispersion.json and dispersion.png")
    probe.set_defaults(run=_dispersion)

    freq = commands.add_parser("freq", help="position frequency f(i) under three packings, with shares and a plot")
    freq.add_argument("--window", "--training-window", type=positive, default=2048, help="training window L (default 2048, as the paper)")
    freq.add_argument("--lengths-file", help="a text file of document lengths, one per line")
    freq.add_argument("--texts", help="a folder of .txt files, tokenized with --model's tokenizer")
    freq.add_argument("--model", default="default", help="tokenizer for --texts (default: the bundled SmolLM2)")
    freq.add_argument("--synthetic", help="lognormal[:mean=6.5,sigma=1.4,count=100000], exponential[:scale=..], fixed[:length=..]")
    freq.add_argument("--seed", type=int, default=0)
    freq.add_argument("--out", default="runs/frequency.png")
    freq.set_defaults(run=_freq)

    pictures = commands.add_parser("matrix", help="a method's relative-position matrix as a picture")
    pictures.add_argument("method", help="method[:param=value,...], e.g. string:shift=3,local_window=1")
    pictures.add_argument("--length", type=positive, default=9, help="matrix size (default 9, the paper's Figure 5)")
    pictures.add_argument("--window", "--training-window", type=positive, help="training window L (default: --length)")
    pictures.add_argument("--out", help="PNG path (default matrix_METHOD_LENGTH.png)")
    pictures.set_defaults(run=_matrix)

    costs = commands.add_parser("cost", help="attention FLOPs, KV-cache and weight memory per length, from a config")
    costs.add_argument("--model", default="default", help="'default', a config.json, a local folder or a hub id")
    costs.add_argument("--lengths", default="4k,32k,128k,1024k", help="k = 1024 (default 4k,32k,128k,1024k)")
    costs.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16", "float8"])
    costs.add_argument("--sliding-window", type=positive, default=4096)
    costs.add_argument("--out", default="runs/cost.png")
    costs.set_defaults(run=_cost)

    tuning = commands.add_parser("tune", help="a grid of a method's parameters on a task at one length: scores with "
                                 "intervals, the best as an apply(...) line (resumable)")
    tuning.add_argument("method", help="a position method, e.g. string, self_extend, dca, dpe")
    tuning.add_argument("--grid", nargs="+", required=True, help="name=value1,value2 per parameter, e.g. shift=1024,2048 local_window=64,128")
    tuning.add_argument("--set", help="parameters held fixed, name=value,... (lists with ;), e.g. local_window=128")
    tuning.add_argument("--task", default="passkey", help="any longreach task (default passkey)")
    tuning.add_argument("--length", default="8k", help="the one context length to tune at (default 8k)")
    tuning.add_argument("--no-baseline", action="store_true", help="leave out the rope row run on the same cases")
    tuning.add_argument("--model", default="default", help="'default', a local path or a HF id")
    tuning.add_argument("--samples", type=positive, default=20, help="cases per setting (default 20)")
    tuning.add_argument("--batch-size", type=positive, default=1, help="cases decoded together (default 1)")
    tuning.add_argument("--limit", type=positive, help="run at most this many new cases")
    tuning.add_argument("--training-window", type=positive, help=TRAINING_WINDOW_HELP)
    tuning.add_argument("--out", help="results folder; a rerun resumes it (default runs/tune_METHOD)")
    tuning.set_defaults(run=_tune)

    calibration = commands.add_parser("calibrate", help="DPE's pair importance and group-scale search on a model (resumable)")
    calibration.add_argument("method", help="dpe")
    calibration.add_argument("--model", default="default", help="'default', a local path or a HF id")
    calibration.add_argument("--length", default="8k", help="the target length the scales are searched for (default 8k)")
    calibration.add_argument("--samples", type=positive, default=10, help="probe cases per setting (default 10)")
    calibration.add_argument("--importance-samples", type=positive, default=10, help="texts per length for pair importance (default 10, as DPE)")
    calibration.add_argument("--local-window", type=positive, default=1024, help="DPE's w (default 1024)")
    calibration.add_argument("--top-k", type=int, help="pairs changed per head (default: 3/4 of the rotary pairs, the paper's 48 of 64; "
                             "0: every pair, no importance measurement)")
    calibration.add_argument("--groups", type=positive, default=8, help="frequency groups (default 8)")
    calibration.add_argument("--task", default="ruler-tight:niah_multivalue",
                             help="the probe (default ruler-tight:niah_multivalue: 4 values, fraction found, the length filled)")
    calibration.add_argument("--batch-size", type=positive, default=1, help="cases decoded together (default 1)")
    calibration.add_argument("--training-window", type=positive, help=TRAINING_WINDOW_HELP)
    calibration.add_argument("--out", help="results folder; a rerun resumes it (default runs/calibrate_dpe_LENGTH)")
    calibration.set_defaults(run=_calibrate)

    probe_cli.add_commands(commands)

    listing = commands.add_parser("methods", help="every method: paper, what it changes, parameters with defaults and ranges")
    listing.set_defaults(run=_methods)

    report = commands.add_parser("report", help="rebuild summary.md and the pictures of a results folder from its JSONL")
    report.add_argument("dir")
    report.add_argument("--threshold", type=threshold, default=RULER_THRESHOLD, help="effective-length threshold (RULER: 85.6)")
    report.set_defaults(run=_report)

    demo = commands.add_parser("demo", help=f"niah4 at {DEMO_LENGTHS} on the default model with rope and string")
    common(demo, "runs/demo", DEMO_SAMPLES)
    demo.set_defaults(run=_demo)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.run(args)
    except (ValueError, RuntimeError, OSError) as error:
        sys.exit(f"longreach: error: {error}")
    except KeyboardInterrupt:
        sys.exit("longreach: interrupted; every finished case is saved, rerun the same command to resume")


if __name__ == "__main__":
    main()

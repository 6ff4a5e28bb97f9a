"""What each ``longreach`` command does, given its parsed arguments (:mod:`.parser` defines them).

Each command imports what it needs when it runs, so that ``--help`` stays fast.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .arguments import existing_file, writable_file, writable_folder

EVAL_SAMPLES = 100  # a pass rate's 95% interval is then at most +-10 points (Wilson, p = 0.5)
MAX_MATRIX = 4096  # matrix pictures are dense length x length arrays


def _grid(args: argparse.Namespace):
    from ..eval import runner, tasks

    names = [name for task in args.task for name in tasks.expand(task)]
    if any(t == "ruler" for t in args.task) and (reason := tasks.qa_available()):
        print(reason)
    methods = [runner.MethodSpec.parse(m) for m in (args.method or ["rope", "string"])]
    return runner.Grid(args.model, names, methods, runner.parse_lengths(args.lengths),
                       runner.depth_grid(args.depths), args.samples, args.training_window, getattr(args, "dtype", "auto"))


def evaluate(args: argparse.Namespace) -> None:
    from ..eval import runner
    from ..eval.distributed import World

    grid = _grid(args)  # every argument checked before anything is written
    out = writable_folder(args.out)
    runner.run(grid, out, limit=args.limit, batch_size=args.batch_size, tp=args.tp, prefill_tokens=args.prefill_tokens,
               command=args.command_line)
    if World.from_environment(args.tp).rank:  # under torchrun, process 0 reports
        return
    _summarize(out, args.threshold)


def report(args: argparse.Namespace) -> None:
    if not Path(args.dir).is_dir():
        raise ValueError(f"{args.dir} is not a results folder")
    _summarize(Path(args.dir), args.threshold)


def _summarize(out: Path, threshold: float) -> None:
    """Write the folder's report files; print its tables as plain text and where the rest is."""
    from ..eval import plain_text, report

    report.build(out, threshold)
    print(plain_text.tables(json.loads((out / "summary.json").read_text(encoding="utf-8"))))
    print(f"\nsummary.md (every table, with the pictures), summary.csv, summary.json and results.jsonl in {out}/")


def dispersion(args: argparse.Namespace) -> None:
    import longreach

    from .. import models
    from ..analysis import dispersion
    from ..eval import haystack, runner

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


def freq(args: argparse.Namespace) -> None:
    import numpy as np

    from ..analysis import frequency

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

        from ..models import default_path

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


def matrix(args: argparse.Namespace) -> None:
    from ..analysis import matrix
    from ..eval import runner

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


def cost(args: argparse.Namespace) -> None:
    from ..analysis import cost
    from ..eval import runner

    shape = cost.shape_of(cost.load_config(args.model))
    lengths = runner.parse_lengths(args.lengths)
    dtype_bytes = cost.DTYPE_BYTES[args.dtype]
    print(f"{shape.name}: {shape.layers} layers, {shape.heads} heads ({shape.kv_heads} KV), head dim {shape.head_dim}, "
          f"{shape.parameters:,} parameters; {args.dtype}\n")
    out = writable_file(args.out)
    print(cost.markdown(cost.table(shape, lengths, dtype_bytes, args.sliding_window), args.sliding_window))
    print(f"\nwrote {cost.plot(shape, lengths, out, dtype_bytes, args.sliding_window)}")


def methods(args: argparse.Namespace) -> None:
    from ..methods import available

    print("| method | kind | paper | what it changes | parameters (default; range) |")
    print("|---|---|---|---|---|")
    for row in available():
        params = "; ".join(f"`{k}`={v!r} ({row['ranges'].get(k, '')})" for k, v in row["parameters"].items()) or "—"
        print(f"| `{row['name']}` | {row['kind']} | {row['paper']} | {row['changes']} | {params} |")
    print("\nAny method also takes protocol=paper on the command line: the STRING paper's baseline set-up "
          "(as if the window were 2L/3, factor 3/2).")


def _single_length(text: str) -> int:
    from ..eval import runner

    lengths = runner.parse_lengths(text)
    if len(lengths) != 1:
        raise ValueError(f"--length={text} gives {len(lengths)} lengths: give one, e.g. 8k")
    return lengths[0]


def tune(args: argparse.Namespace) -> None:
    from ..eval import runner, tasks, tune
    from ..methods import METHODS

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


def calibrate(args: argparse.Namespace) -> None:
    from ..eval import calibrate, tasks

    if args.method != "dpe":
        raise ValueError(f"calibrate measures DPE's settings; got {args.method!r} (use `longreach tune` for other methods)")
    tasks.get(args.task)
    length = _single_length(args.length)  # before the default folder's name is made of it
    out = writable_folder(args.out or f"runs/calibrate_dpe_{args.length}").resolve()
    result = calibrate.calibrate(args.model, length, out, args.samples, args.local_window, args.top_k,
                                 args.importance_samples, args.task, args.groups, args.training_window, args.batch_size)
    print((out / "calibration.md").read_text(encoding="utf-8"))
    print(f"use: {result['apply']}\ncalibration.md, calibration.json, calibration.png and dimensions.safetensors in {out}/")


def demo(args: argparse.Namespace) -> None:
    from ..demo import main

    out = writable_folder(args.out)
    print(main(out, args.cases))
    print(f"\ndemo.txt (this report), demo.png (the picture) and demo.json (every case) in {out}/\n"
          "Your own document, each method side by side: longreach ask FILE \"QUESTION\"   or, in a browser: longreach serve-demo")


def _methods(args: argparse.Namespace) -> list:
    from ..eval import runner

    return [runner.MethodSpec.parse(m) for m in (args.method or ["rope", "string"])]


def ask(args: argparse.Namespace) -> None:
    from .. import ask as asking

    document, methods = asking.read_document(args.file), _methods(args)
    model, tokenizer, window = asking.load(args.model, methods, args.training_window)
    text, reading = asking.reading(tokenizer, window, document, args.question, args.max_new_tokens)
    print(reading.describe(), flush=True)
    for answer in asking.answers(model, tokenizer, text, methods, window, args.max_new_tokens):
        distance = asking.distance_to_question(tokenizer, document, answer.text)
        where = "" if distance is None else f"; its words stand {distance:,} tokens before the question"
        print(f"\n[{answer.method}] ({answer.seconds:.1f} s{where})\n{answer.text}", flush=True)


def serve_demo(args: argparse.Namespace) -> None:
    from .. import demo_page

    demo_page.serve(args.model, _methods(args), args.host, args.port, args.max_new_tokens)



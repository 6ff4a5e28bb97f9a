"""The analyses: ``dispersion`` (attention spreading thin), ``freq`` (position frequency), ``matrix`` (a method's
relative positions), ``cost`` (FLOPs and memory per length), and ``methods`` (every method and its parameters)."""

from __future__ import annotations

import argparse
from pathlib import Path

from . import flags
from .arguments import existing_file, positive, writable_file, writable_folder

MAX_MATRIX = 4096  # matrix pictures are dense length x length arrays


def add(subcommands) -> None:
    probe = subcommands.add_parser("dispersion", help="top-k attention probability vs position, per layer, per method")
    flags.model(probe)
    probe.add_argument("--text", help="a text file (default: the Paul Graham essays)")
    probe.add_argument("--length", default="12k", help="tokens of text to read, k = 1024 (default 12k)")
    flags.methods(probe, help="methods to compare, repeatable (default: rope and dynamic_drop)")
    probe.add_argument("--points", type=positive, default=24, help="query positions sampled evenly (default 24)")
    probe.add_argument(
        "--top-k", type=positive, default=1, help="mean of the k largest probabilities (default 1: the max)"
    )
    flags.training_window(probe)
    probe.add_argument(
        "--out",
        default="runs/dispersion",
        help="folder for dispersion.json and dispersion.png (default runs/dispersion)",
    )
    probe.set_defaults(run=dispersion)

    frequencies = subcommands.add_parser(
        "freq", help="position frequency f(i) under three packings, with shares and a plot"
    )
    frequencies.add_argument(
        "--window",
        "--training-window",
        type=positive,
        default=2048,
        help="training window L (default 2048, as the paper)",
    )
    frequencies.add_argument("--lengths-file", help="a text file of document lengths in tokens, one per line")
    frequencies.add_argument("--texts", help="a folder of .txt files, tokenized with --model's tokenizer")
    flags.model(frequencies, help="tokenizer for --texts (default: the bundled SmolLM2's)")
    frequencies.add_argument(
        "--synthetic", help="lognormal[:mean=6.5,sigma=1.4,count=100000], exponential[:scale=..], fixed[:length=..]"
    )
    frequencies.add_argument("--seed", type=int, default=0, help="random seed of --synthetic lengths (default 0)")
    frequencies.add_argument(
        "--out", default="runs/frequency.png", help="PNG path of the plot (default runs/frequency.png)"
    )
    frequencies.set_defaults(run=freq)

    pictures = subcommands.add_parser("matrix", help="a method's relative-position matrix as a picture")
    pictures.add_argument("method", help="method[:param=value,...], e.g. string:shift=3,local_window=1")
    pictures.add_argument(
        "--length", type=positive, default=9, help="matrix size in tokens (default 9, the paper's Figure 5)"
    )
    pictures.add_argument("--window", "--training-window", type=positive, help="training window L (default: --length)")
    pictures.add_argument("--out", help="PNG path (default matrix_METHOD_LENGTH.png)")
    pictures.set_defaults(run=matrix)

    costs = subcommands.add_parser("cost", help="attention FLOPs, KV-cache and weight memory per length, from a config")
    flags.model(costs, help="'default', 'gemma3-270m', a .gguf file, a config.json, a folder or a hub id")
    costs.add_argument(
        "--lengths", default="4k,32k,128k,1024k", help="lengths in tokens, k = 1024 (default 4k,32k,128k,1024k)"
    )
    costs.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["float32", "bfloat16", "float16", "float8"],
        help="bytes per weight and cache value (default bfloat16)",
    )
    costs.add_argument(
        "--sliding-window", type=positive, default=4096, help="the sliding window compared, in tokens (default 4096)"
    )
    costs.add_argument("--out", default="runs/cost.png", help="PNG path of the plot (default runs/cost.png)")
    costs.set_defaults(run=cost)


def add_listing(subcommands) -> None:
    listing = subcommands.add_parser(
        "methods", help="every method: paper, what it changes, parameters with defaults and ranges"
    )
    listing.set_defaults(run=methods)
    layers = subcommands.add_parser(
        "inspect", help="a model's attention layers and RoPE layout, and what each method would do on it (config only)"
    )
    layers.add_argument(
        "model", help="a saved model's folder, a config.json, a Hugging Face id, 'default', or a family ('glm4')"
    )
    flags.training_window(layers)
    layers.set_defaults(run=inspect)


def inspect(args: argparse.Namespace) -> None:
    from ..inspection import inspect as inspect_model

    print(inspect_model(args.model, args.training_window))


def dispersion(args: argparse.Namespace) -> None:
    from .. import models
    from ..analysis import dispersion
    from ..eval import haystack, on_model
    from ..eval.grid import check_lengths
    from ..integrations.transformers import remove, training_window

    text = existing_file(args.text, "--text").read_text(encoding="utf-8") if args.text else haystack.essays()
    length = flags.single_length(args.length, "12k")
    methods = flags.method_specs(args, ["rope", "dynamic_drop"])
    out = writable_folder(args.out)
    on_model.check(methods, models.load_config(args.model), args.training_window)
    model, tokenizer = models.load(args.model)
    window = args.training_window or training_window(model.config)
    check_lengths([length], window)
    results = {}
    for spec in methods:
        on_model.apply(model, spec, window)
        print(f"probing {spec.label} at {length} tokens ...", flush=True)
        results[spec.label] = dispersion.measure(model, tokenizer, text, length, args.points, args.top_k)
    remove(model)
    print(
        f"wrote {dispersion.save(results, out / 'dispersion.json')} and "
        f"{dispersion.plot(results, out / 'dispersion.png', window)}"
    )


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

        from ..models import source_of

        tokenizer = AutoTokenizer.from_pretrained(source_of(args.model))
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
    from ..methods.spec import MethodSpec

    spec = MethodSpec.parse(args.method)
    if args.length > MAX_MATRIX:
        raise ValueError(f"--length={args.length} is out of range: 1 .. {MAX_MATRIX} (the matrix is drawn whole)")
    P, description = matrix.matrix(spec.name, args.length, args.window, **dict(spec.params))
    out = writable_file(args.out or f"matrix_{spec.name}_{args.length}.png")
    groups = [P] if P.ndim == 2 else [P[..., g] for g in range(P.shape[-1])]
    scales = dict(spec.params).get("group_scales", ())
    titles = [f"frequency group {g} (scale {s})" for g, s in enumerate(scales)] or None
    if args.length <= 24:
        for g, panel in enumerate(groups):
            print(titles[g] if titles and len(groups) > 1 else "", end="\n" if len(groups) > 1 else "")
            # NaN: not attended
            print("\n".join(" ".join("  ." if v != v else f"{v:3g}" for v in row) for row in panel))
    print(f"wrote {matrix.plot(P, f'{description}, L = {args.window or args.length}', out, panel_titles=titles)}")


def cost(args: argparse.Namespace) -> None:
    from ..analysis import cost
    from ..eval.grid import parse_lengths

    shape = cost.shape_of(cost.load_config(args.model))
    lengths = parse_lengths(args.lengths)
    dtype_bytes = cost.DTYPE_BYTES[args.dtype]
    print(
        f"{shape.name}: {shape.layers} layers, {shape.heads} heads ({shape.kv_heads} KV), head dim {shape.head_dim}, "
        f"{shape.parameters:,} parameters; {args.dtype}\n"
    )
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
    print(
        "\nAny method also takes protocol=paper on the command line: the STRING paper's baseline set-up "
        "(as if the window were 2L/3, factor 3/2)."
    )

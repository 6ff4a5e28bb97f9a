"""The ``longreach`` command's arguments: every subcommand and flag, each with its help.

Building the parser imports nothing heavy (no torch, transformers or matplotlib), so ``--help`` and
``--version`` answer at once; the commands themselves (:mod:`.commands`) import what they need.
"""

from __future__ import annotations

import argparse

from ..eval.records import DTYPES
from ..eval.stats import RULER_THRESHOLD
from ..probe import cli as probe_cli
from . import commands
from .arguments import positive, prefill_tokens, threshold

TRAINING_WINDOW_HELP = "the training window L every default derives from (default: the config's max_position_embeddings)"
MODEL_HELP = "'default' (the bundled SmolLM2-135M-Instruct), a local folder or a Hugging Face id"
THRESHOLD_HELP = "the score an effective length must reach at every length up to it (default RULER's 85.6)"


class Version(argparse.Action):
    """``--version``: longreach's version, and its git commit when it runs from a clone."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="print longreach's version (and git commit, from a clone) and exit")

    def __call__(self, parser, namespace, values, option_string=None):
        from ..provenance import describe

        print(describe())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="longreach", description="Measure and extend the context RoPE models really use.")
    parser.add_argument("--version", action=Version)
    subcommands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _eval_commands(subcommands)
    _analysis_commands(subcommands)
    _tuning_commands(subcommands)
    probe_cli.add_commands(subcommands)
    listing = subcommands.add_parser("methods", help="every method: paper, what it changes, parameters with defaults and ranges")
    listing.set_defaults(run=commands.methods)
    return parser


def _grid_options(p: argparse.ArgumentParser, out: str, samples: int) -> None:
    """The options ``eval`` and ``demo`` share: the model, cases, batching, the results folder."""
    p.add_argument("--model", default="default", help=MODEL_HELP)
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
    p.add_argument("--threshold", type=threshold, default=RULER_THRESHOLD, help=THRESHOLD_HELP)


def _eval_commands(subcommands) -> None:
    evaluate = subcommands.add_parser("eval", help="run a task over methods x lengths x depths x seeds (resumable)")
    evaluate.add_argument("task", nargs="+", help="niah4, niah4-chat, passkey, passkey-chat, niah, ppl, ruler (all 13), "
                          "or ruler:<name>, e.g. ruler:vt")
    evaluate.add_argument("--method", action="append",
                          help="method[:param=value,...], repeatable (default: rope and string), e.g. string:shift=2048, "
                          "dca:protocol=paper, yarn:factor=2; see `longreach methods`")
    evaluate.add_argument("--lengths", default="2k,4k,8k", help="context lengths, k = 1024 (default 2k,4k,8k)")
    evaluate.add_argument("--depths", type=positive, default=5, help="grid depths from 0 to 1 for the niah heatmap task; its "
                          "cases cycle through them (default 5)")
    evaluate.add_argument("--dtype", choices=DTYPES, default="auto",
                          help="weights and activations: auto is the checkpoint's own (float32 for the default model; "
                          "bfloat16 for most published ones, as upstream runs them)")
    _grid_options(evaluate, "runs/eval", commands.EVAL_SAMPLES)
    evaluate.set_defaults(run=commands.evaluate)

    report = subcommands.add_parser("report", help="rebuild summary.md, summary.csv, summary.json and the pictures of a "
                                    "results folder from its results.jsonl")
    report.add_argument("dir", metavar="DIR", help="a results folder (holding results.jsonl)")
    report.add_argument("--threshold", type=threshold, default=RULER_THRESHOLD, help=THRESHOLD_HELP)
    report.set_defaults(run=commands.report)

    demo = subcommands.add_parser("demo", help="STRING's effect where it can be measured in minutes: rope and string by "
                                  "distance on the probing experiment's window-256 model (make demo; resumable)")
    demo.add_argument("--cases", type=positive, default=100, help="cases per distance and method (default 100)")
    demo.add_argument("--out", default="runs/demo", help="folder for demo.txt, demo.png and demo.json (default runs/demo)")
    demo.set_defaults(run=commands.demo)

    asking = subcommands.add_parser("ask", help="ask a question about your own document; each method answers it, side by side")
    asking.add_argument("file", metavar="FILE", help="a text (.txt), Markdown (.md) or PDF (.pdf) file")
    asking.add_argument("question", metavar="QUESTION", help="what to ask about it")
    _answer_options(asking)
    asking.add_argument("--training-window", type=positive, help=TRAINING_WINDOW_HELP)
    asking.set_defaults(run=commands.ask)

    page = subcommands.add_parser("serve-demo", help="a local web page: paste or upload a document, ask, and read each "
                                  "method's answer side by side")
    _answer_options(page)
    page.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    page.add_argument("--port", type=positive, default=7860, help="port (default 7860)")
    page.set_defaults(run=commands.serve_demo)


def _answer_options(p: argparse.ArgumentParser) -> None:
    """The options ``ask`` and ``serve-demo`` share."""
    p.add_argument("--model", default="default", help=MODEL_HELP)
    p.add_argument("--method", action="append", help="method[:param=value,...], repeatable (default: rope and string)")
    p.add_argument("--max-new-tokens", type=positive, default=64, help="tokens each answer may take (default 64)")


def _analysis_commands(subcommands) -> None:
    probe = subcommands.add_parser("dispersion", help="top-k attention probability vs position, per layer, per method")
    probe.add_argument("--model", default="default", help=MODEL_HELP)
    probe.add_argument("--text", help="a text file (default: the Paul Graham essays)")
    probe.add_argument("--length", default="12k", help="tokens of text to read, k = 1024 (default 12k)")
    probe.add_argument("--method", action="append", help="methods to compare, repeatable (default: rope and dynamic_drop)")
    probe.add_argument("--points", type=positive, default=24, help="query positions sampled evenly (default 24)")
    probe.add_argument("--top-k", type=positive, default=1, help="mean of the k largest probabilities (default 1: the max)")
    probe.add_argument("--training-window", type=positive, help=TRAINING_WINDOW_HELP)
    probe.add_argument("--out", default="runs/dispersion", help="folder for dispersion.json and dispersion.png (default runs/dispersion)")
    probe.set_defaults(run=commands.dispersion)

    freq = subcommands.add_parser("freq", help="position frequency f(i) under three packings, with shares and a plot")
    freq.add_argument("--window", "--training-window", type=positive, default=2048, help="training window L (default 2048, as the paper)")
    freq.add_argument("--lengths-file", help="a text file of document lengths in tokens, one per line")
    freq.add_argument("--texts", help="a folder of .txt files, tokenized with --model's tokenizer")
    freq.add_argument("--model", default="default", help="tokenizer for --texts (default: the bundled SmolLM2's)")
    freq.add_argument("--synthetic", help="lognormal[:mean=6.5,sigma=1.4,count=100000], exponential[:scale=..], fixed[:length=..]")
    freq.add_argument("--seed", type=int, default=0, help="random seed of --synthetic lengths (default 0)")
    freq.add_argument("--out", default="runs/frequency.png", help="PNG path of the plot (default runs/frequency.png)")
    freq.set_defaults(run=commands.freq)

    pictures = subcommands.add_parser("matrix", help="a method's relative-position matrix as a picture")
    pictures.add_argument("method", help="method[:param=value,...], e.g. string:shift=3,local_window=1")
    pictures.add_argument("--length", type=positive, default=9, help="matrix size in tokens (default 9, the paper's Figure 5)")
    pictures.add_argument("--window", "--training-window", type=positive, help="training window L (default: --length)")
    pictures.add_argument("--out", help="PNG path (default matrix_METHOD_LENGTH.png)")
    pictures.set_defaults(run=commands.matrix)

    costs = subcommands.add_parser("cost", help="attention FLOPs, KV-cache and weight memory per length, from a config")
    costs.add_argument("--model", default="default", help="'default', a config.json, a local folder or a Hugging Face id")
    costs.add_argument("--lengths", default="4k,32k,128k,1024k", help="lengths in tokens, k = 1024 (default 4k,32k,128k,1024k)")
    costs.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16", "float8"],
                       help="bytes per weight and cache value (default bfloat16)")
    costs.add_argument("--sliding-window", type=positive, default=4096, help="the sliding window compared, in tokens (default 4096)")
    costs.add_argument("--out", default="runs/cost.png", help="PNG path of the plot (default runs/cost.png)")
    costs.set_defaults(run=commands.cost)


def _tuning_commands(subcommands) -> None:
    tuning = subcommands.add_parser("tune", help="a grid of a method's parameters on a task at one length: scores with "
                                    "intervals, the best as an apply(...) line (resumable)")
    tuning.add_argument("method", help="a position method, e.g. string, self_extend, dca, dpe")
    tuning.add_argument("--grid", nargs="+", required=True, help="name=value1,value2 per parameter, e.g. shift=1024,2048 local_window=64,128")
    tuning.add_argument("--set", help="parameters held fixed, name=value,... (lists with ;), e.g. local_window=128")
    tuning.add_argument("--task", default="passkey", help="any longreach task (default passkey)")
    tuning.add_argument("--length", default="8k", help="the one context length to tune at, k = 1024 (default 8k)")
    tuning.add_argument("--no-baseline", action="store_true", help="leave out the rope row run on the same cases")
    tuning.add_argument("--model", default="default", help=MODEL_HELP)
    tuning.add_argument("--samples", type=positive, default=20, help="cases per setting (default 20)")
    tuning.add_argument("--batch-size", type=positive, default=1, help="cases decoded together (default 1)")
    tuning.add_argument("--limit", type=positive, help="run at most this many new cases")
    tuning.add_argument("--training-window", type=positive, help=TRAINING_WINDOW_HELP)
    tuning.add_argument("--out", help="results folder; a rerun resumes it (default runs/tune_METHOD)")
    tuning.set_defaults(run=commands.tune)

    calibration = subcommands.add_parser("calibrate", help="DPE's pair importance and group-scale search on a model (resumable)")
    calibration.add_argument("method", help="the method to calibrate: dpe")
    calibration.add_argument("--model", default="default", help=MODEL_HELP)
    calibration.add_argument("--length", default="8k", help="the target length the scales are searched for (default 8k)")
    calibration.add_argument("--samples", type=positive, default=10, help="probe cases per setting (default 10)")
    calibration.add_argument("--importance-samples", type=positive, default=10, help="texts per length for pair importance (default 10, as DPE)")
    calibration.add_argument("--local-window", type=positive, default=1024, help="DPE's w in tokens (default 1024)")
    calibration.add_argument("--top-k", type=int, help="pairs changed per head (default: 3/4 of the rotary pairs, the paper's 48 of 64; "
                             "0: every pair, no importance measurement)")
    calibration.add_argument("--groups", type=positive, default=8, help="frequency groups (default 8)")
    calibration.add_argument("--task", default="ruler-tight:niah_multivalue",
                             help="the probe (default ruler-tight:niah_multivalue: 4 values, fraction found, the length filled)")
    calibration.add_argument("--batch-size", type=positive, default=1, help="cases decoded together (default 1)")
    calibration.add_argument("--training-window", type=positive, help=TRAINING_WINDOW_HELP)
    calibration.add_argument("--out", help="results folder; a rerun resumes it (default runs/calibrate_dpe_LENGTH)")
    calibration.set_defaults(run=commands.calibrate)

"""``longreach eval`` (a task over methods x lengths x depths x seeds, resumable) and ``longreach report`` (a results
folder's summary, rebuilt)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from pathlib import Path

from ..eval.engines import ENGINES
from ..eval.prompt_form import TEMPLATES, PromptForm
from ..eval.records import DTYPES
from ..eval.task_protocol import EVALUATE
from . import flags
from .arguments import positive, prefill_tokens, writable_folder

SERVED_BATCH = 64  # cases submitted at a time to vLLM or a server: it batches them itself
EVAL_SAMPLES = 100  # a pass rate's 95% interval is then at most +-10 points (Wilson, p = 0.5)


def add(subcommands) -> None:
    evaluating = subcommands.add_parser("eval", help="run a task over methods x lengths x depths x seeds (resumable)")
    evaluating.add_argument(
        "task",
        nargs="+",
        help="niah4, niah4-chat (niah4:question=llama3.1 asks as STRING asks Llama 3.1, chosen for such a model), "
        "passkey, passkey-chat, niah, ppl, ruler (all 13), or ruler:<name>, e.g. ruler:vt; infbench (the STRING "
        "paper's nine) or infbench:<name>, e.g. infbench:passkey",
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
    evaluating.add_argument(
        "--data",
        metavar="DIR|FILE",
        help="InfiniteBench's published jsonl files: a folder of them, or one task's file (default: the Hugging Face "
        "hub's xinrongzhang2022/InfiniteBench, downloaded once into its cache)",
    )
    _prompt_options(evaluating)
    _grid_options(evaluating, "runs/eval", EVAL_SAMPLES)
    _engine_options(evaluating)
    evaluating.set_defaults(run=evaluate)

    reporting = subcommands.add_parser(
        "report",
        help="rebuild summary.md, summary.csv, summary.json and the pictures of a "
        "results folder from its results.jsonl",
    )
    reporting.add_argument("dir", metavar="DIR", help="a results folder (holding results.jsonl)")
    flags.score_threshold(reporting)
    reporting.set_defaults(run=report)


def _prompt_options(p: argparse.ArgumentParser) -> None:
    """How templated tasks' prompts are dressed (:mod:`longreach.eval.prompt_form`); on every engine."""
    p.add_argument(
        "--template",
        choices=TEMPLATES,
        default="auto",
        help="RULER's model template for templated tasks (ruler:*, niah, the -chat forms): chat (the tokenizer's chat "
        "template), base (the bare text), or auto (chat where the tokenizer has one; default)",
    )
    p.add_argument(
        "--chat-template-kwargs",
        metavar="JSON",
        help="the chat template's switches, as vLLM and lm-eval take them, e.g. '{\"enable_thinking\": false}'",
    )
    p.add_argument(
        "--thinking",
        type=positive,
        metavar="N",
        help="a thinking run (RULER's advice for reasoning models): no answer prefix, N tokens to think beyond the "
        "task's own, and the answer scored after the </think> block, which each record keeps",
    )


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
    p.add_argument(
        "--batch-size",
        type=positive,
        help="cases decoded together, left-padded (default 1); on vLLM or a server, cases submitted at a time "
        f"(default {SERVED_BATCH})",
    )
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
        type=positive,
        nargs="?",
        const=0,
        metavar="N",
        help="under torchrun: shard the model over the processes (tensor parallelism) instead of sharing out the "
        "cases; with --engine vllm: vLLM's tensor-parallel size",
    )
    flags.training_window(p)
    flags.score_threshold(p)


def _engine_options(p: argparse.ArgumentParser) -> None:
    """Where the cases run: transformers in this process, vLLM's offline engine, or an OpenAI-compatible server."""
    p.add_argument(
        "--engine",
        choices=ENGINES,
        default="transformers",
        help="transformers in this process (default), or vLLM's offline engine with longreach's plugin",
    )
    vllm = "with --engine vllm:"
    p.add_argument("--pp", type=positive, default=1, metavar="N", help=f"{vllm} vLLM's pipeline-parallel size")
    p.add_argument("--dp", type=positive, default=1, metavar="N", help=f"{vllm} N engines side by side, cases shared")
    p.add_argument(
        "--server",
        metavar="URL",
        help="measure the model behind an OpenAI-compatible completions endpoint (e.g. http://localhost:8000); the "
        "prompts are built with --tokenizer; --method is the server's own, so not given",
    )
    p.add_argument("--tokenizer", help="with --server: the model's tokenizer (default: --model)")
    p.add_argument(
        "--served-model",
        metavar="NAME",
        help="with --server: the served model to ask, as GET /v1/models names it (default: the one named as --model; "
        "a server serving another model is refused)",
    )
    p.add_argument("--label", default="served", help="with --server: the method label of its records (default served)")
    p.add_argument(
        "--concurrency", type=positive, default=8, metavar="N", help="with --server: requests in flight (default 8)"
    )


def _engine_problem(args: argparse.Namespace) -> str | None:
    """Flags that do not go together, as one line."""
    if args.served_model and not args.server:
        return f"--served-model {args.served_model} goes with --server"
    if args.server:
        if args.method:
            return f"--method {args.method[0]} with --server: the server runs its own method; name it with --label"
        if args.engine != "transformers":
            return f"--engine {args.engine} with --server: give one of them"
    if args.engine == "transformers" and not args.server:
        for name in ("pp", "dp"):
            if getattr(args, name) != 1:
                return f"--{name} {getattr(args, name)} needs --engine vllm (under torchrun, processes share the cases)"
    if args.engine == "vllm" and args.tp == 0:
        return "--tp with --engine vllm takes the tensor-parallel size: --tp N"
    if args.engine == "vllm" and args.prefill_tokens is not None:
        return "--prefill-tokens with --engine vllm: vLLM chunks prefill itself (max_num_batched_tokens)"
    return None


def _grid(args: argparse.Namespace):
    from ..eval.grid import Grid, depth_grid, parse_lengths

    tasks = flags.task_registry()
    names = [name for task in args.task for name in tasks.expand(task)]
    if (chosen := tasks.for_model(names, args.model)) != names:
        print("niah4: STRING's question for Llama 3.1 (niah4:question=llama3.1; niah4:question=standard: the other)")
        names = chosen
    if any(t == "ruler" for t in args.task) and (reason := tasks.qa_available()):
        print(reason)
    for name in dict.fromkeys(names):
        if problem := tasks.data_problem(name):
            raise ValueError(problem)
    return Grid(
        args.model,
        names,
        flags.method_specs(args),
        parse_lengths(args.lengths),
        depth_grid(args.depths),
        args.samples,
        args.training_window,
        args.dtype,
    )


def evaluate(args: argparse.Namespace) -> None:
    from ..eval import distributed, runner

    if problem := _engine_problem(args):
        raise ValueError(problem)
    if args.server:
        args.method = [args.label]
    if args.data:  # read where the cases are built: here, torchrun's processes and --dp's children
        from ..eval.infbench.data import DATA

        os.environ[DATA] = args.data
    grid = _grid(args)  # every argument checked before anything is written
    args.form = PromptForm.parse(args.template, args.chat_template_kwargs, args.thinking)
    elsewhere = args.server or args.engine != "transformers"
    if elsewhere and (scored := [t for t in grid.tasks if flags.task_registry().get(t).kind == EVALUATE]):
        where = "--server" if args.server else f"--engine {args.engine}"
        raise ValueError(f"task {scored[0]} scores the model's logits, which {where} does not give: use transformers")
    out = writable_folder(args.out)
    parallel = distributed.Parallel(args.tp or 1, args.pp, args.dp)
    first = not distributed.is_data_parallel_child() and os.environ.get("RANK", "0") == "0"  # --dp's parent, rank 0
    with runner.only_writer(out) if first else contextlib.nullcontext():  # the other processes are its own
        _evaluate(args, grid, out, parallel, elsewhere)
    if first:  # process 0 of torchrun's reports; --dp's parent
        summarize(out, args.threshold)


def _evaluate(args: argparse.Namespace, grid, out: Path, parallel, elsewhere) -> None:
    from ..eval import distributed, runner

    if parallel.dp > 1 and not distributed.is_data_parallel_child():  # this command again in --dp processes
        distributed.data_parallel(parallel, out, args.argv, runner.merge)
    else:
        world = (
            distributed.World.from_data_parallel()
            if elsewhere
            else distributed.World.from_environment(tp=args.tp is not None)
        )
        batch_size = args.batch_size or (SERVED_BATCH if elsewhere else 1)
        engine = _engine(args, parallel)
        runner.run(grid, out, engine, world, args.limit, batch_size, args.command_line, args.form)


def _engine(args: argparse.Namespace, parallel):
    """What runs the cases: a server, vLLM, or transformers in this process."""
    if args.server:
        from transformers import AutoTokenizer

        from .. import models
        from ..eval.engines.server import Server

        tokenizer = AutoTokenizer.from_pretrained(models.source_of(args.tokenizer or args.model))
        return Server(args.server, tokenizer, args.concurrency, model=args.model, served=args.served_model)
    if args.engine == "vllm":
        from ..eval.engines.vllm import Vllm

        return Vllm(parallel)
    from ..eval.engines.transformers import Transformers

    return Transformers(prefill_tokens=args.prefill_tokens)


def report(args: argparse.Namespace) -> None:
    if not Path(args.dir).is_dir():
        raise ValueError(f"{args.dir} is not a results folder")
    summarize(Path(args.dir), args.threshold)


def summarize(out: Path, threshold: float) -> None:
    """Write the folder's report files; print its tables as plain text and where the rest is."""
    from ..eval import report
    from ..eval.report import plain_text

    report.build(out, threshold)
    print(plain_text.tables(json.loads((out / "summary.json").read_text(encoding="utf-8"))))
    print(f"\nsummary.md (every table, with the pictures), summary.csv, summary.json and results.jsonl in {out}/")

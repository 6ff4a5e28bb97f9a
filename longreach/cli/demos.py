"""``longreach demo`` (STRING's effect where it can be measured in minutes), ``longreach ask`` (a question about your
own document, each method's answer side by side) and ``longreach serve-demo`` (the same as a local web page)."""

from __future__ import annotations

import argparse

from . import flags
from .arguments import port, positive, writable_folder


def add(subcommands) -> None:
    demonstrating = subcommands.add_parser(
        "demo",
        help="STRING's effect where it can be measured in minutes: rope "
        "and string by distance on the probing experiment's window-256 model (make "
        "demo; resumable)",
    )
    demonstrating.add_argument(
        "--cases", type=positive, default=100, help="cases per distance and method (default 100)"
    )
    demonstrating.add_argument(
        "--out", default="runs/demo", help="folder for demo.txt, demo.png and demo.json (default runs/demo)"
    )
    demonstrating.set_defaults(run=demo)

    asking = subcommands.add_parser(
        "ask", help="ask a question about your own document; each method answers it, side by side"
    )
    asking.add_argument("file", metavar="FILE", help="a text (.txt), Markdown (.md) or PDF (.pdf) file")
    asking.add_argument("question", metavar="QUESTION", help="what to ask about it")
    _answer_options(asking)
    flags.training_window(asking)
    asking.set_defaults(run=ask)

    page = subcommands.add_parser(
        "serve-demo",
        help="a local web page: paste or upload a document, ask, and read each method's answer side by side",
    )
    _answer_options(page)
    page.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    page.add_argument("--port", type=port, default=7860, help="port, 1 .. 65535 (default 7860)")
    page.set_defaults(run=serve_demo)


def _answer_options(p: argparse.ArgumentParser) -> None:
    """The options ``ask`` and ``serve-demo`` share."""
    flags.model(p)
    flags.methods(p)
    p.add_argument("--max-new-tokens", type=positive, default=64, help="tokens each answer may take (default 64)")


def demo(args: argparse.Namespace) -> None:
    from ..demo import main

    out = writable_folder(args.out)
    print(main(out, args.cases))
    print(
        f"\ndemo.txt (this report), demo.png (the picture) and demo.json (every case) in {out}/\n"
        'Your own document, each method side by side: longreach ask FILE "QUESTION"   or, in a browser: '
        "longreach serve-demo"
    )


def ask(args: argparse.Namespace) -> None:
    from .. import ask as asking
    from ..eval.generate import set_up_line

    document, methods = asking.read_document(args.file), flags.method_specs(args)
    model, tokenizer, window = asking.load(args.model, methods, args.training_window)
    text, reading = asking.reading(tokenizer, window, document, args.question, args.max_new_tokens)
    print(reading.describe(), flush=True)
    print(set_up_line(asking.warm_up(model, methods, window)), flush=True)
    for answer in asking.answers(model, tokenizer, text, methods, window, args.max_new_tokens):
        distance = asking.distance_to_question(tokenizer, document, answer.text)
        where = "" if distance is None else f"; its words stand {distance:,} tokens before the question"
        print(f"\n[{answer.method}] ({answer.seconds:.1f} s{where})\n{answer.text}", flush=True)


def serve_demo(args: argparse.Namespace) -> None:
    from .. import demo_page

    demo_page.serve(args.model, flags.method_specs(args), args.host, args.port, args.max_new_tokens)

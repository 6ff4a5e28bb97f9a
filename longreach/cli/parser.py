"""The ``longreach`` command's parser: every subcommand, in the order ``--help`` lists them, each from its module.

Building the parser imports nothing heavy (no torch, transformers or matplotlib), so ``--help`` and
``--version`` answer at once; the commands themselves import what they need when they run.
"""

from __future__ import annotations

import argparse

from . import analyses, demos, evaluation, probing, tuning


class Version(argparse.Action):
    """``--version``: longreach's version, and its git commit when it runs from a clone."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(
            option_strings,
            dest,
            nargs=0,
            default=argparse.SUPPRESS,
            help="print longreach's version (and git commit, from a clone) and exit",
        )

    def __call__(self, parser, namespace, values, option_string=None):
        from ..provenance import describe

        print(describe())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="longreach", description="Measure and extend the context RoPE models really use."
    )
    parser.add_argument("--version", action=Version)
    subcommands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    evaluation.add(subcommands)
    demos.add(subcommands)
    analyses.add(subcommands)
    tuning.add(subcommands)
    probing.add(subcommands)
    analyses.add_listing(subcommands)
    return parser

"""The flags several ``longreach`` commands share, declared once here (with their help), and read once here.

Declaring them imports nothing heavy; reading them (:func:`method_specs`, :func:`single_length`, :func:`task_registry`)
imports what it needs when a command runs.
"""

from __future__ import annotations

import argparse

from ..eval.stats import RULER_THRESHOLD
from .arguments import positive, threshold

TRAINING_WINDOW_HELP = (
    "the training window L every default derives from (default: the config's max_position_embeddings)"
)
MODEL_HELP = (
    "'default' (the bundled SmolLM2-135M-Instruct, L = 8K), 'gemma3-270m' (the bundled Gemma 3 270M base, L = 32K), "
    "a .gguf file, a local folder or a Hugging Face id"
)
THRESHOLD_HELP = "the score an effective length must reach at every length up to it (default RULER's 85.6)"
METHODS_HELP = "method[:param=value,...], repeatable (default: rope and string)"
DEFAULT_METHODS = ["rope", "string"]


def model(p: argparse.ArgumentParser, help: str = MODEL_HELP) -> None:
    p.add_argument("--model", default="default", help=help)


def methods(p: argparse.ArgumentParser, help: str = METHODS_HELP) -> None:
    p.add_argument("--method", action="append", help=help)


def training_window(p: argparse.ArgumentParser) -> None:
    p.add_argument("--training-window", type=positive, help=TRAINING_WINDOW_HELP)


def score_threshold(p: argparse.ArgumentParser, help: str = THRESHOLD_HELP) -> None:
    p.add_argument("--threshold", type=threshold, default=RULER_THRESHOLD, help=help)


def batch_size(p: argparse.ArgumentParser, help: str = "cases decoded together (default 1)") -> None:
    p.add_argument("--batch-size", type=positive, default=1, help=help)


def method_specs(args: argparse.Namespace, default: list[str] = DEFAULT_METHODS) -> list:
    """``--method``'s specs (:class:`~longreach.methods.spec.MethodSpec`), each parsed; ``default`` when none is
    given."""
    from ..methods.spec import MethodSpec

    return [MethodSpec.parse(m) for m in (args.method or default)]


def single_length(text: str, example: str = "8k") -> int:
    """``--length``: one length in tokens (``k`` = 1024), or a one-line error."""
    from ..eval.grid import parse_lengths

    lengths = parse_lengths(text)
    if len(lengths) != 1:
        raise ValueError(f"--length={text} gives {len(lengths)} lengths: give one, e.g. {example}")
    return lengths[0]


def task_registry():
    """``longreach eval``'s task registry (:mod:`longreach.eval.tasks`) with every package's tasks in it: importing
    :mod:`longreach.probe.task` registers ``probe`` and ``probe-tail``."""
    from ..eval import tasks
    from ..probe import task  # noqa: F401 -- registers the probe's tasks

    return tasks

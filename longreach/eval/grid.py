"""The grid of an evaluation: methods x tasks x lengths x depths x seeds, each case's key made as it is read; the
command line's lengths and depths, read and checked against the model's window."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass

from ..methods.base import LARGEST
from ..methods.spec import MethodSpec
from . import tasks
from .records import DTYPES, MAX_LENGTH, CaseKey

MAX_SAMPLES = 10_000  # cases per (task, length, method): a pass rate's 95% interval is then within +-1 point


def parse_lengths(text: str) -> list[int]:
    """``2k,4k,8192`` -> ``[2048, 4096, 8192]`` (k = 1024)."""
    lengths = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        try:
            number = float(item[:-1]) * 1024 if item.lower().endswith("k") else float(item)
        except ValueError:
            number = 0.5
        if not math.isfinite(number) or number < 16 or number > MAX_LENGTH or number != int(number):
            raise ValueError(
                f"length {item!r} is out of range: a whole number of tokens from 16 to {MAX_LENGTH} (e.g. 2k, 4096)"
            )
        lengths.append(int(number))
    if not lengths:
        raise ValueError("--lengths is empty: give e.g. 2k,4k,8k")
    return lengths


LENGTH_BOUND = 32  # lengths above 32 x L are refused: no method here is meant to reach that far


def check_lengths(lengths: list[int], window: int) -> None:
    """Refuse lengths above ``LENGTH_BOUND x L``; say so when lengths exceed L (methods that extrapolate are meant for
    that)."""
    if too_long := [n for n in lengths if n > LENGTH_BOUND * window]:
        raise ValueError(
            f"--lengths {too_long[0]} is out of range: at most {LENGTH_BOUND} x L = {LENGTH_BOUND * window} tokens "
            f"for this model (L = {window})"
        )
    if beyond := [n for n in lengths if n > window]:
        print(f"note: lengths {', '.join(map(str, beyond))} exceed the model's training window L = {window}")


def depth_grid(count: int) -> list[float]:
    """``count`` depths evenly from 0 (start) to 1 (end)."""
    if count < 1:
        raise ValueError(f"--depths={count} is out of range: at least 1")
    return [0.5] if count == 1 else [round(i / (count - 1), 4) for i in range(count)]


@dataclass
class Grid:
    """Every case of an evaluation: ``samples`` cases per (task, length, method).

    Args:
        model: ``default``, a local folder or a hub id.
        tasks: task names (``niah4``, ``passkey``, ``ruler:vt``, ...).
        methods: the methods, each run on the same cases.
        lengths: lengths in tokens, everything included (prompt, template, tokens to generate).
        depths: for a task with a depth grid (``niah``): case ``i`` sits at ``depths[i % len(depths)]``;
            every other task draws its own needle positions, as upstream.
        samples: cases per task, length and method.
        training_window: ``L``; default the model's.
        dtype: ``auto`` (the checkpoint's own), ``float32``, ``bfloat16`` or ``float16``.
    """

    model: str
    tasks: list[str]
    methods: list[MethodSpec]
    lengths: list[int]
    depths: list[float]
    samples: int
    training_window: int | None = None  # None: the model's own L
    dtype: str = "auto"  # one of DTYPES

    def __post_init__(self) -> None:
        if not 1 <= self.samples <= MAX_SAMPLES:
            raise ValueError(f"--samples={self.samples} is out of range: 1 .. {MAX_SAMPLES}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype={self.dtype} is not one of: {', '.join(DTYPES)}")
        if self.training_window is not None and not 2 <= self.training_window <= LARGEST:
            raise ValueError(
                f"--training-window={self.training_window} is out of range: an integer >= 2 (tokens), at most {LARGEST}"
            )
        self.methods = list({m.label: m for m in self.methods}.values())  # --method rope --method rope: once
        for task in self.tasks:
            tasks.get(task)

    def __len__(self) -> int:
        return len(self.tasks) * len(self.lengths) * self.samples * len(self.methods)

    def keys(self) -> Iterator[CaseKey]:
        """Every case's key (the model as named, the method's label), made as they are read, longer
        lengths last (early results are the cheap ones)."""
        for task in self.tasks:
            grid = tasks.get(task).uses_depth
            for length, seed, method in itertools.product(self.lengths, range(self.samples), self.methods):
                depth = self.depths[seed % len(self.depths)] if grid else None
                yield CaseKey(self.model, method.label, task, length, depth, seed)

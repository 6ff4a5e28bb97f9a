"""The resumable grid runner: methods x tasks x lengths x depths x seeds -> one JSONL line per case, on any engine.

Every finished case is appended to ``DIR/results.jsonl`` at once (flushed and synced), so a crash or
Ctrl-C loses nothing; a rerun with the same folder skips what is there (a truncated last line is
ignored and recomputed). :func:`run` is the one driver: resume, the checks, the pending cases, provenance and the
merge, for every engine (:mod:`.engines`); :mod:`.outcomes` runs the pending cases (a progress bar with ETA);
``limit`` caps the new cases.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .. import models, provenance
from ..methods.spec import MethodSpec
from . import tasks
from .distributed import World, shares
from .engines.base import Engine
from .engines.transformers import Transformers
from .outcomes import Setting, run_cases
from .records import DTYPES, MAX_LENGTH, RESULTS, CaseKey, case_key, end_cut_off_line, read_results

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
        if self.training_window is not None and self.training_window < 2:
            raise ValueError(f"--training-window={self.training_window} is out of range: an integer >= 2 (tokens)")
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


def run(
    grid: Grid,
    out: Path,
    engine: Engine | None = None,
    world: World | None = None,
    limit: int | None = None,
    batch_size: int = 1,
    command: str | None = None,
) -> Path:
    """Run the grid's missing cases on ``engine`` (what ``longreach eval`` does), appending each to
    ``out/results.jsonl``: the one driver of every engine (:class:`.engines.base.Engine`).

    Cases already in the folder are skipped, so a rerun resumes; a folder holds one engine's cases in one precision.
    Cases of one (task, length) are built once for every method. Where ``world`` shares the cases out over processes
    (``torchrun``, ``--dp``), each runs its share into a file of its own, merged into ``results.jsonl`` when all are
    done (:mod:`.distributed`).

    Args:
        grid: every case to run.
        out: the results folder.
        engine: what runs the cases; default the transformers engine, loading ``grid.model``.
        world: this process's place among the processes; default :meth:`.World.from_environment` (``torchrun``).
        limit: at most this many new cases (per process where the cases are shared out).
        batch_size: cases of one task, length and method given to the engine together.
        command: the command line recorded in ``out/runs.jsonl`` (default: this process's, as ``longreach ...``).

    Returns:
        The path of ``results.jsonl``.
    """
    if batch_size < 1:
        raise ValueError(f"--batch-size={batch_size} is out of range: at least 1")
    engine = engine or Transformers()
    world = world or World.from_environment()
    out.mkdir(parents=True, exist_ok=True)
    path = out / RESULTS
    earlier = [r for file in [path, *shares(out, RESULTS)] for r in read_results(file)]
    check_engine(earlier, engine.name, out)  # before the engine starts: a folder of another engine's is refused at once
    try:
        resolved = engine.start(grid, world)
        check_lengths(grid.lengths, engine.window)
        check_dtype(earlier, engine.dtype, out)
        setting = Setting(
            grid.model,
            models.identity(grid.model),
            engine.window,
            engine.dtype,
            {m.label: m for m in grid.methods},
            resolved,
            batch_size,
        )
        world.barrier()  # everyone has read what is done before anyone writes (tensor-parallel processes run the same)
        pending = _pending(grid, setting, _finished(earlier, grid.model, setting.model_key), world, out, limit, engine)
        if pending:  # process 0 records who ran it, with what, on which model, as its first case is written
            this_run = (
                None if world.rank else provenance.run(grid.model, engine.config, len(pending), world.size, command)
            )
            run_cases(setting, pending, engine, world, world.results_file(out, RESULTS), this_run)
    finally:
        engine.close()
    world.barrier()
    if world.merges and shares(out, RESULTS):
        merge(out)
    return path


def _pending(grid: Grid, setting: Setting, done: set[CaseKey], world: World, out: Path, limit: int | None, engine):
    """This process's share of the grid's keys not ``done``, at most ``limit``; method by method where the engine holds
    one method at a time. Says how many there are, in one line."""
    mine = list(world.share(grid.keys(), lambda key: key.case))
    pending = [k for k in mine if k._replace(model=setting.model_key, method=setting.resolved[k.method]) not in done]
    already = len(mine) - len(pending)
    if engine.one_method_at_a_time:
        order = list(setting.specs)
        pending.sort(key=lambda key: order.index(key.method))
    pending = pending[:limit]
    if world.writes:
        where = f"process {world.rank} of {world.size}: " if world.shares_cases else ""
        print(f"{where}{len(mine)} cases in the grid, {already} already in {out}, running {len(pending)}")
    return pending


def _finished(records: list[dict], name: str, model_key: str) -> set[CaseKey]:
    """The keys of the cases done (failed ones are tried again); records from before the model's identity was kept
    count under the name given."""
    return {
        case_key(r)._replace(model=model_key) if not r.get("model_key") and r["model"] == name else case_key(r)
        for r in records
        if not r.get("error")
    }


def merge(out: Path) -> None:
    """Append the records of the per-process files (data parallel) to ``results.jsonl``, then remove them."""
    path, left = out / RESULTS, shares(out, RESULTS)
    good = {case_key(r) for r in read_results(path) if not r.get("error")}
    with path.open("a", encoding="utf-8") as sink:
        end_cut_off_line(path, sink)
        for share in left:
            for record in read_results(share):
                if case_key(record) not in good:
                    sink.write(json.dumps(record) + "\n")
        sink.flush()
        os.fsync(sink.fileno())
    for share in left:
        share.unlink()


def check_engine(records: list[dict], engine: str, out: Path) -> None:
    """A results folder holds one engine's cases (records from before the field was kept ran in transformers)."""
    held = {r.get("engine", "transformers") for r in records}
    if held - {engine}:
        raise ValueError(
            f"this run's engine is {engine}, but {out} holds results of {', '.join(sorted(held))}: "
            f"resume it with that engine, or give another --out"
        )


def check_dtype(records: list[dict], dtype: str, out: Path) -> None:
    """A results folder holds one precision: resuming it in another would mix two measurements."""
    held = {r.get("dtype", "float32") for r in records}  # records from before the field was kept ran in float32
    if held - {dtype}:
        raise ValueError(
            f"--dtype resolves to {dtype}, but {out} holds results in {', '.join(sorted(held))}: "
            f"resume it with that --dtype, or give another --out"
        )

"""The resumable grid runner: methods x tasks x lengths x depths x seeds -> one JSONL line per case, on any engine.

Every finished case is appended to ``DIR/results.jsonl`` at once (flushed and synced), so a crash or
Ctrl-C loses nothing; a rerun with the same folder skips what is there (a truncated last line is
ignored and recomputed). :func:`run` is the one driver: resume, the checks, the pending cases, provenance and the
merge, for every engine (:mod:`.engines`); :mod:`.outcomes` runs the pending cases (a progress bar with ETA);
``limit`` caps the new cases.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from pathlib import Path

from .. import models, provenance
from . import tasks
from .distributed import World, shares
from .engines.base import Engine
from .engines.transformers import Transformers
from .grid import Grid, check_lengths
from .outcomes import Setting, run_cases
from .prompt_form import PromptForm, check_form
from .records import RESULTS, CaseKey, case_key, end_cut_off_line, read_results


def run(
    grid: Grid,
    out: Path,
    engine: Engine | None = None,
    world: World | None = None,
    limit: int | None = None,
    batch_size: int = 1,
    command: str | None = None,
    form: PromptForm | None = None,
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
        form: how the prompts are dressed (:class:`.prompt_form.PromptForm`; default: the tokenizer's chat template
            where a templated task has one, as RULER's). A folder holds one form.

    Returns:
        The path of ``results.jsonl``.
    """
    if batch_size < 1:
        raise ValueError(f"--batch-size={batch_size} is out of range: at least 1")
    engine, form = engine or Transformers(), form or PromptForm()
    world = world or World.from_environment()
    out.mkdir(parents=True, exist_ok=True)
    path = out / RESULTS
    earlier = [r for file in [path, *shares(out, RESULTS)] for r in read_results(file)]
    check_engine(earlier, engine.name, out)  # before the engine starts: a folder of another engine's is refused at once
    check_form(earlier, form, out)
    try:
        resolved = engine.start(grid, world)
        check_lengths(grid.lengths, engine.window)
        check_dtype(earlier, engine.dtype, out)
        form.check(engine.tokenizer, grid.tasks, tasks.get)
        setting = Setting(
            grid.model,
            models.identity(grid.model),
            engine.window,
            engine.dtype,
            {m.label: m for m in grid.methods},
            resolved,
            batch_size,
            form,
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


@contextlib.contextmanager
def only_writer(out: Path) -> Iterator[None]:
    """Hold ``out`` for this run alone (an exclusive lock on the folder itself, which the system releases when the
    process ends, however it ends): a second run given the same folder meanwhile is refused in one line, rather than
    running every case again beside it."""
    folder = os.open(out, os.O_RDONLY)
    try:
        try:
            fcntl.flock(folder, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ValueError(
                f"{out} is being written by another run: wait for it to finish, or give another --out"
            ) from None
        yield
    finally:
        os.close(folder)


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

"""Each pending case's outcome: build each case once for every method, run it on the engine, score it, and append
its record to the results file at once (flushed and synced). A case's outcome is its own: one that fails, or whose
answer cannot be scored, is an error row of its own while the others go on."""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from .. import provenance
from ..methods.spec import MethodSpec
from . import ruler, tasks
from .distributed import World
from .engines.base import EngineGone
from .prompt_form import PromptForm
from .records import CaseKey, end_cut_off_line
from .task_protocol import EVALUATE, AnyTask


@dataclass(frozen=True)
class Setting:
    """What every case of one run shares.

    Args:
        model: the model as named (``--model``).
        model_key: its identity (:func:`longreach.models.identity`).
        window: ``L``.
        dtype: the precision it runs in (``float32``, ...).
        specs: the methods by label.
        resolved: each label's method as resolved (every parameter and ``L``).
        batch_size: cases of one task, length and method given to the engine together.
        form: how the prompts are dressed (``--template``, ``--chat-template-kwargs``, ``--thinking``).
    """

    model: str
    model_key: str
    window: int
    dtype: str
    specs: dict[str, MethodSpec]
    resolved: dict[str, str]
    batch_size: int
    form: PromptForm = PromptForm()


@dataclass
class Batch:
    """Cases of one task, one length and one method, given to the engine together."""

    task: AnyTask
    length: int
    label: str
    keys: list[CaseKey]
    cases: list  # each key's case, or the error that building it raised
    build_seconds: float  # per case


def run_cases(
    setting: Setting, pending: list[CaseKey], engine, world: World, path: Path, this_run: dict | None
) -> None:
    """Run ``pending`` cases on ``engine`` (:class:`.engines.base.Engine`), one JSON line each in ``path`` (only where
    ``world`` writes), each as soon as its outcome is known; ``this_run`` (process 0's) goes into the folder's
    ``runs.jsonl`` with the first case, so a run that fails before it leaves nothing behind."""
    desc = f"cases (process {world.rank})" if world.shares_cases else "cases"
    position = world.rank if world.shares_cases else 0
    with (
        _Sink(path, this_run) if world.writes else contextlib.nullcontext() as sink,
        tqdm(total=len(pending), desc=desc, unit="case", position=position, disable=not world.writes) as bar,
    ):
        for batch in _batches(setting, pending, engine.tokenizer):
            bar.set_postfix_str(f"{batch.task.name} {batch.length} {batch.label}")
            for at, fields, seconds in _run_batch(batch.task, engine, batch.label, batch.cases):
                key = batch.keys[at]
                if fields.get("error"):
                    bar.write(f"case {key.task} {key.length} {key.method} seed {key.seed} failed: {fields['error']}")
                if sink:
                    sink.write(_record(setting, key, fields, seconds + batch.build_seconds, len(batch.keys), engine))
                bar.update()


def _batches(setting: Setting, pending: list[CaseKey], tokenizer) -> Iterator[Batch]:
    """The pending keys as batches, in their order: each case of a (task, length) built once for every method, up to
    ``batch_size`` cases at a time (one for a task that evaluates the model itself); tasks and tokenizer dressed in
    the run's prompt form."""
    tokenizer = setting.form.tokenizer(tokenizer)
    for (task_name, length), group in itertools.groupby(pending, key=lambda key: (key.task, key.length)):
        keys, task = list(group), setting.form.task(tasks.get(task_name))
        cases = list(dict.fromkeys((key.depth, key.seed) for key in keys))  # in grid order
        size = 1 if task.kind == EVALUATE else setting.batch_size
        for chunk in (cases[i : i + size] for i in range(0, len(cases), size)):
            start = time.perf_counter()
            built = {where: _build(task, tokenizer, length, *where) for where in chunk}
            build_seconds = (time.perf_counter() - start) / len(chunk)
            for label in setting.specs:
                batch = [key for key in keys if key.method == label and (key.depth, key.seed) in built]
                if batch:
                    yield Batch(task, length, label, batch, [built[k.depth, k.seed] for k in batch], build_seconds)


def _record(setting: Setting, key: CaseKey, fields: dict, seconds: float, batch_size: int, engine) -> dict:
    """A case's line of the results file (:mod:`.records`): what makes the case, its outcome, and how it ran."""
    decoded_with = fields.pop("batch", batch_size)
    return {
        "model": setting.model,
        "model_key": setting.model_key,
        "method": key.method,
        "resolved": setting.resolved[key.method],
        "window": setting.window,
        "task": key.task,
        "length": key.length,
        "depth": key.depth,
        "seed": key.seed,
        **fields,
        "seconds": round(seconds, 3),
        "batch": decoded_with,
        "machine": engine.machine,
        "dtype": setting.dtype,
        **setting.form.record,
        **engine.record,
    }


class _Sink:
    """``path`` open for appending (a line a crash cut short ended first), each record flushed and synced as it is
    written; ``this_run`` recorded in the folder's ``runs.jsonl`` before the first."""

    def __init__(self, path: Path, this_run: dict | None):
        self.path, self.this_run = path, this_run

    def __enter__(self) -> _Sink:
        self.stream = self.path.open("a", encoding="utf-8")
        end_cut_off_line(self.path, self.stream)
        return self

    def __exit__(self, *exc) -> None:
        self.stream.close()

    def write(self, record: dict) -> None:
        if self.this_run is not None:
            provenance.record(self.path.parent, self.this_run)
            self.this_run = None
        self.stream.write(json.dumps(record) + "\n")
        self.stream.flush()
        os.fsync(self.stream.fileno())


def _build(task, tokenizer, length: int, depth, seed: int):
    """The case, or the error that building it raised (an error row for every method, the grid goes on)."""
    try:
        return task.build(tokenizer, length, depth, seed)
    except Exception as error:
        return error


def _error(error: BaseException) -> dict:
    return {"score": None, "error": f"{error.__class__.__name__}: {error}"}


def _run_batch(task, engine, label: str, cases: list) -> Iterator[tuple[int, dict, float]]:
    """``(index, record fields, seconds)`` of each case as the engine finishes it, scored; a case that could not be
    built, or a batch that raises, becomes error rows (one failing case must not stop the grid; a rerun retries).
    Each case gets its own outcome: one whose answer cannot be scored keeps its answer, with the scoring error."""
    ready = [i for i, case in enumerate(cases) if not isinstance(case, Exception)]
    for i, case in enumerate(cases):
        if isinstance(case, Exception):
            yield i, _error(case), 0.0
    if not ready:
        return
    left = set(ready)
    try:
        engine.ready(label)  # the method applied, or its engine started: not the cases' time
        start = time.perf_counter()
        for at, fields in engine.decode(task, label, [cases[i] for i in ready]):
            index, case = ready[at], cases[ready[at]]
            left.discard(index)
            seconds = (time.perf_counter() - start) / len(ready)
            yield index, _scored(task, case, fields), seconds
    except EngineGone:
        raise
    except Exception as error:  # every case not finished: an error row each
        for index in sorted(left):
            yield index, _error(error), 0.0


def _scored(task, case, fields: dict) -> dict:
    """:func:`_case_fields`, or, where scoring the answer raises, the answer kept with the error named (an error row,
    which a rerun tries again)."""
    try:
        return _case_fields(task, case, fields)
    except Exception as error:
        kept = {"answer": fields["answer"]} if isinstance(fields.get("answer"), str) else {}
        return {**kept, "score": None, "error": f"scoring the answer failed: {error.__class__.__name__}: {error}"}


def _case_fields(task, case, fields: dict) -> dict:
    """What a record keeps of a case and its outcome: the answer scored (a generated task), or the fields the task's
    evaluation gave."""
    if fields.get("error"):
        return {"score": None, **fields}
    if task.kind != EVALUATE:  # a thinking run scores, and keeps as the answer, the text after the thinking
        scored = task.score(fields["answer"], case)
        fields = {**fields, "empty": not ruler.postprocess(scored.get("answer", fields["answer"])), **scored}
    return {
        "n_tokens": case.n_tokens,
        "max_new_tokens": case.max_new_tokens,
        "haystack_units": case.haystack_units,
        **({"searched_units": case.searched_units} if case.searched_units is not None else {}),
        "prompt_hash": hashlib.sha256(case.prompt.encode()).hexdigest()[:16],
        "references": case.references,
        "needle_depths": case.needle_depths,
        "metric": case.metric,
        **fields,
    }

"""Running the grid's pending cases: build each case once for every method, decode or evaluate it, score it,
and append its record to the results file at once (flushed and synced)."""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from tqdm import tqdm

from .. import provenance
from ..methods.spec import MethodSpec
from . import ruler, tasks
from .distributed import World
from .engines import EngineGone
from .records import CaseKey, end_cut_off_line
from .task import EVALUATE


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
        batch_size: cases of one task, length and method decoded together.
        prefill_tokens: the prefill budget (:func:`longreach.eval.runner.run`).
    """

    model: str
    model_key: str
    window: int
    dtype: str
    specs: dict[str, MethodSpec]
    resolved: dict[str, str]
    batch_size: int
    prefill_tokens: int | None


def run_cases(
    setting: Setting, pending: list[CaseKey], engine, world: World, path: Path, this_run: dict | None
) -> None:
    """Run ``pending`` cases by ``engine`` (:mod:`.engines`), one JSON line each in ``path`` (only where ``world``
    writes), each as soon as its outcome is known; ``this_run`` (process 0's) goes into the folder's ``runs.jsonl`` with
    the first case, so a run that fails before it leaves nothing behind."""
    machine = engine.machine
    desc = f"cases (process {world.rank})" if world.shares_cases else "cases"
    position = world.rank if world.shares_cases else 0
    with (
        path.open("a", encoding="utf-8") if world.writes else contextlib.nullcontext() as sink,
        tqdm(total=len(pending), desc=desc, unit="case", position=position, disable=not world.writes) as bar,
    ):
        if sink:
            end_cut_off_line(path, sink)
        for (task_name, length), keys in itertools.groupby(pending, key=lambda key: (key.task, key.length)):
            keys, task = list(keys), tasks.get(task_name)
            cases = list(dict.fromkeys((key.depth, key.seed) for key in keys))  # in grid order
            size = 1 if task.kind == EVALUATE else setting.batch_size
            for chunk in (cases[i : i + size] for i in range(0, len(cases), size)):
                start = time.perf_counter()
                built = {where: _build(task, engine.tokenizer, length, *where) for where in chunk}
                build_seconds = (time.perf_counter() - start) / len(chunk)
                for label in setting.specs:
                    batch = [key for key in keys if key.method == label and (key.depth, key.seed) in built]
                    if not batch:
                        continue
                    bar.set_postfix_str(f"{task_name} {length} {label}")
                    for at, record, seconds in _run_batch(task, engine, label, [built[k.depth, k.seed] for k in batch]):
                        key = batch[at]
                        if record.get("error"):
                            bar.write(f"case {task_name} {length} {label} seed {key.seed} failed: {record['error']}")
                        decoded_with = record.pop("batch", len(batch))
                        record = {
                            "model": setting.model,
                            "model_key": setting.model_key,
                            "method": label,
                            "resolved": setting.resolved[label],
                            "window": setting.window,
                            "task": task_name,
                            "length": length,
                            "depth": key.depth,
                            "seed": key.seed,
                            **record,
                            "seconds": round(seconds + build_seconds, 3),
                            "batch": decoded_with,
                            "machine": machine,
                            "dtype": setting.dtype,
                            **engine.record,
                        }
                        if sink:
                            if this_run is not None:
                                provenance.record(path.parent, this_run)
                                this_run = None
                            sink.write(json.dumps(record) + "\n")
                            sink.flush()
                            os.fsync(sink.fileno())
                        bar.update()


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
    if task.kind != EVALUATE:
        fields = {**fields, "empty": not ruler.postprocess(fields["answer"]), **task.score(fields["answer"], case)}
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

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

from tqdm import tqdm

from .. import provenance
from ..methods.spec import MethodSpec
from . import ruler, specs, tasks
from .distributed import World
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
    setting: Setting, pending: list[CaseKey], model, tokenizer, world: World, path: Path, this_run: dict | None
) -> None:
    """Run ``pending`` cases, one JSON line each in ``path`` (only where ``world`` writes); ``this_run`` (process 0's)
    goes into the folder's ``runs.jsonl`` with the first case, so a run that fails before it leaves nothing behind."""
    state = {"applied": None}

    def apply(label: str) -> None:
        if state["applied"] != label:
            specs.apply(model, setting.specs[label], setting.window)
            state["applied"] = label

    machine = _machine(model)
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
                built = {where: _build(task, tokenizer, length, *where) for where in chunk}
                build_seconds = (time.perf_counter() - start) / len(chunk)
                for label in setting.specs:
                    batch = [key for key in keys if key.method == label and (key.depth, key.seed) in built]
                    if not batch:
                        continue
                    bar.set_postfix_str(f"{task_name} {length} {label}")
                    results = _run_batch(
                        task,
                        model,
                        tokenizer,
                        [built[key.depth, key.seed] for key in batch],
                        lambda: apply(label),
                        setting.prefill_tokens,
                    )
                    for key, (record, seconds) in zip(batch, results):
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
                        }
                        if sink:
                            if this_run is not None:
                                provenance.record(path.parent, this_run)
                                this_run = None
                            sink.write(json.dumps(record) + "\n")
                            sink.flush()
                            os.fsync(sink.fileno())
                        bar.update()


def _machine(model) -> str:
    """What ran the cases, for the time per case: 'cpu' or the GPU's name, e.g. 'cuda: NVIDIA H100 80GB HBM3'."""
    import torch

    return f"cuda: {torch.cuda.get_device_name(model.device)}" if model.device.type == "cuda" else model.device.type


def _build(task, tokenizer, length: int, depth, seed: int):
    """The case, or the error that building it raised (an error row for every method, the grid goes on)."""
    try:
        return task.build(tokenizer, length, depth, seed)
    except Exception as error:
        return error


def _error(error: BaseException) -> dict:
    return {"score": None, "error": f"{error.__class__.__name__}: {error}"}


def _run_batch(task, model, tokenizer, cases: list, apply, prefill_tokens: int | None) -> list[tuple[dict, float]]:
    """``(record fields, seconds)`` per case: decoded together; a case that could not be built, or a
    batch that raises, becomes error rows (one failing case must not stop the grid; a rerun retries).
    A method whose frequencies follow the forward's longest sequence (dynamic NTK) decodes each case
    alone, in one forward: its answer is then its own, whatever the batch size and prefill budget."""
    from ..integrations.transformers import one_case_per_forward
    from . import generate

    ready = [case for case in cases if not isinstance(case, Exception)]
    start = time.perf_counter()
    try:
        apply()
        if task.kind == EVALUATE:
            outcomes = [task.evaluate(model, tokenizer, case) for case in ready]
        else:
            alone = one_case_per_forward(model) and len(ready) > 1
            budget = 0 if one_case_per_forward(model) else generate.prefill_budget(len(ready), prefill_tokens)
            groups = [[case] for case in ready] if alone else [ready] if ready else []
            prompts = [[case.prompt for case in group] for group in groups]
            answers = [a for p in prompts for a in generate.greedy(model, tokenizer, p, task.max_new_tokens, budget)]
            outcomes = [
                {
                    "answer": answer,
                    "empty": not ruler.postprocess(answer),
                    "prefill_tokens": budget,
                    **({"batch": 1} if alone else {}),
                    **task.score(answer, case),
                }
                for answer, case in zip(answers, ready)
            ]
    except Exception as error:
        outcomes = [_error(error)] * len(ready)
    seconds = (time.perf_counter() - start) / max(1, len(ready))
    outcome = iter(outcomes)
    results = []
    for case in cases:
        if isinstance(case, Exception):
            results.append((_error(case), 0.0))
        else:
            fields = next(outcome)
            if not fields.get("error"):
                fields = {
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
            results.append((dict(fields), seconds))
    return results

"""Effective length of a probe checkpoint: retrieval accuracy by distance, with and without a method.

A case (:func:`.corpus.retrieval_case`) is one window of filler with ``needles`` records of distinct keys
and, at its end, a query for the record ``d`` tokens back, the 4-needle test's shape. It passes when the
model's greedy next token after ``ASK k`` is the record's value. Every method runs on the same
cases (the case of distance ``d`` and index ``s`` is seeded by both), so a method's paired difference from
``rope`` is a per-case comparison. Effective length is RULER's rule over distances: the largest tested
distance up to which every distance's accuracy reaches the threshold.
"""

from __future__ import annotations

import numpy as np
import torch

from ..eval import stats
from .corpus import EVERY, RECORD, retrieval_case

NEEDLES = 4


SHORTEST = 2 * EVERY
"""The shortest distance tested: two items' worth of document. Shorter ones are the corpus's rarest retrievals, not
its best trained (a query a few tokens after its own record needs those two items drawn side by side and that
record asked): the first run of the experiment scored 78-86% at distance 3 and 100% from 19 on, which RULER's
rule would have turned into an effective length of 0 at every checkpoint."""


def distances(window: int, count: int = 16) -> list[int]:
    """``count`` distances spread evenly from :data:`SHORTEST` to the longest a window holds."""
    longest = window - 2 * RECORD
    return sorted({int(round(d)) for d in np.linspace(min(SHORTEST, longest), longest, count)})


@torch.no_grad()
def accuracy(model, window: int, distance: int, cases: int, seed: int = 0, batch: int = 32) -> list[bool]:
    """Whether ``model`` retrieves the record at ``distance`` in each of ``cases`` cases."""
    results = []
    for first in range(0, cases, batch):
        built = [
            retrieval_case(window, distance, NEEDLES, np.random.default_rng([seed, distance, index]))
            for index in range(first, min(cases, first + batch))
        ]
        ids = torch.from_numpy(np.stack([tokens for tokens, _, _ in built]))
        logits = model(input_ids=ids).logits
        for row, (_, position, answer) in enumerate(built):
            results.append(int(logits[row, position].argmax()) == answer)
    return results


def by_distance(model, window: int, grid: list[int], cases: int, seed: int = 0) -> dict[int, dict]:
    """Per distance: ``n``, ``accuracy`` (%), its 95% Wilson interval, and every case's result (for pairing)."""
    table = {}
    for distance in grid:
        passed = accuracy(model, window, distance, cases, seed)
        low, high = stats.wilson(sum(passed), len(passed))
        table[distance] = {
            "n": len(passed),
            "accuracy": 100.0 * sum(passed) / len(passed),
            "low": low,
            "high": high,
            "cases": passed,
        }
    return table


def effective_length(table: dict[int, dict], threshold: float) -> int:
    """RULER's rule over distances: the largest distance up to which every accuracy reaches ``threshold`` (0: none)."""
    return stats.effective_length({d: row["accuracy"] for d, row in table.items()}, threshold)


def paired_difference(
    method: dict[int, dict], baseline: dict[int, dict], band: list[int]
) -> tuple[float, tuple[float, float], int]:
    """The method minus the baseline over the cases of the distances in ``band`` (percentage points), with a
    bootstrap interval over those cases and their number."""
    mine = {(d, i): 100.0 * ok for d in band for i, ok in enumerate(method[d]["cases"])}
    theirs = {(d, i): 100.0 * ok for d in band for i, ok in enumerate(baseline[d]["cases"])}
    return stats.paired_difference(mine, theirs)


RESULTS = "measure.json"


def measure_run(
    run,
    methods: list[str],
    cases: int = 100,
    count: int = 16,
    seed: int = 0,
    progress: bool = True,
    final_only: bool = False,
) -> dict:
    """Measure every checkpoint of a training run (``final_only``: its last) with every method
    (``name[:param=value,...]``, as ``longreach eval``'s ``--method``), into ``RUN/measure.json``; a rerun
    measures only what is missing.

    Returns ``{step: {"tokens_seen": ..., "methods": {method: {distance: row}}}}`` (JSON keys are strings).
    """
    import json
    from pathlib import Path

    from tqdm.auto import tqdm

    from ..eval import on_model
    from ..integrations.transformers import remove
    from ..methods.spec import MethodSpec
    from .train import checkpoints, load, state_of

    run = Path(run)
    path = run / RESULTS
    results = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    found = checkpoints(run)[-1:] if final_only else checkpoints(run)
    if not found:
        raise ValueError(f"{run} holds no checkpoint (step_N/ with state.json): train one with `longreach probe train`")
    todo = {
        c: [m for m in methods if m not in results.get(str(state_of(c)["step"]), {}).get("methods", {})] for c in found
    }
    bar = tqdm(total=sum(map(len, todo.values())), desc=f"measure {run.name}", disable=not progress)
    for checkpoint, missing in ((c, m) for c, m in todo.items() if m):
        model, state = load(checkpoint)  # once per checkpoint: each method is applied, measured and removed
        window = state["corpus"]["window"]
        for method in missing:
            on_model.apply(model, MethodSpec.parse(method), window)
            table = by_distance(model, window, distances(window, count), cases, seed)
            remove(model)
            entry = results.setdefault(str(state["step"]), {"tokens_seen": state["tokens_seen"], "methods": {}})
            entry["methods"][method] = {str(d): row for d, row in table.items()}
            path.write_text(json.dumps(results), encoding="utf-8")  # after every checkpoint and method: resumable
            bar.update(1)
    bar.close()
    return results

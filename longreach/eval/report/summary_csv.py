"""``summary.csv``: one row per model, task, length and method, with RULER's own two numbers per task.

RULER's ``scripts/eval/evaluate.py`` writes, per length folder, a transposed table: a row ``Tasks``,
a row ``Score`` (the task's score in percent, two decimals) and a row ``Nulls`` (empty answers, as
``k/n``). A longreach folder holds many lengths and methods, so its rows are those columns' cells,
one per (model, task, length, method), with the same Score and Nulls, and beside them the interval
and n of ``summary.md`` and the method's effective lengths on the task, by RULER's rule and by NoLiMa's, each by the
point estimates and sure (a spreadsheet or ``pandas.read_csv`` reads it as it is).
"""

from __future__ import annotations

import csv
from pathlib import Path

NAME = "summary.csv"
EFFECTIVE = ("point", "sure", "relative", "relative_sure")  # summary["effective_length"]'s, as the columns below
COLUMNS = (
    "model",
    "task",
    "length",
    "method",
    "metric",
    "score",
    "low",
    "high",
    "n",
    "nulls",
    "effective_length",
    "sure_effective_length",
    "relative_effective_length",
    "sure_relative_effective_length",
)


def write(path: Path, summary: dict) -> Path:
    """Write ``summary["cells"]`` (:func:`longreach.eval.report.build`'s) as CSV rows, sorted by model, task, length,
    method; a perplexity cell's score is its perplexity and it has no nulls (no answers)."""
    rows = sorted(summary["cells"], key=lambda c: (c["model"], c["task"], c["length"], c["method"]))
    effective = {(e["model"], e["task"], e["method"]): e for e in summary["effective_length"]}
    with path.open("w", encoding="utf-8", newline="") as sink:
        writer = csv.writer(sink)
        writer.writerow(COLUMNS)
        for cell in rows:
            answered = cell.get("metric") != "perplexity"
            writer.writerow(
                [
                    cell["model"],
                    cell["task"],
                    cell["length"],
                    cell["method"],
                    cell.get("metric", ""),
                    _round(cell["score"]),
                    _round(cell["low"]),
                    _round(cell["high"]),
                    cell["n"],
                    f"{cell['empty']}/{cell['n']}" if answered else "",
                    *_lengths(effective.get((cell["model"], cell["task"], cell["method"]))),
                ]
            )
    return path


def _round(value: float | None) -> str:
    """Two decimals, as RULER's scores; empty where there is no value (one case leaves no interval)."""
    return "" if value is None else f"{value:.2f}"


def _lengths(entry: dict | None) -> list:
    """The four effective lengths in tokens (0: none reaches it), empty where there are none (perplexity)."""
    return ["" if entry is None or entry.get(key) is None else entry[key] for key in EFFECTIVE]

"""``summary.csv``: one row per model, task, length and method, with RULER's own two numbers per task.

RULER's ``scripts/eval/evaluate.py`` writes, per length folder, a transposed table: a row ``Tasks``,
a row ``Score`` (the task's score in percent, two decimals) and a row ``Nulls`` (empty answers, as
``k/n``). A longreach folder holds many lengths and methods, so its rows are those columns' cells,
one per (model, task, length, method), with the same Score and Nulls, and beside them the interval
and n of ``summary.md`` (a spreadsheet or ``pandas.read_csv`` reads it as it is).
"""

from __future__ import annotations

import csv
from pathlib import Path

NAME = "summary.csv"
COLUMNS = ("model", "task", "length", "method", "metric", "score", "low", "high", "n", "nulls")


def write(path: Path, summary: dict) -> Path:
    """Write ``summary["cells"]`` (:func:`longreach.eval.report.build`'s) as CSV rows, sorted by model, task, length,
    method; a perplexity cell's score is its perplexity and it has no nulls (no answers)."""
    rows = sorted(summary["cells"], key=lambda c: (c["model"], c["task"], c["length"], c["method"]))
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
                ]
            )
    return path


def _round(value: float | None) -> str:
    """Two decimals, as RULER's scores; empty where there is no value (one case leaves no interval)."""
    return "" if value is None else f"{value:.2f}"

"""The report's tables as plain text for a terminal (what ``longreach eval`` and ``report`` print at the end).

Read from ``summary.json`` alone: per model and task (and per RULER family), each method's score by
length with its 95% interval and n, its effective length, and each method minus rope on the same cases
(the paired difference in points, its interval, and the pairs).
"""

from __future__ import annotations

from collections import defaultdict

from ...plots import length_text, method_name
from .cells import effective_text
from .pictures import score_label


def tables(summary: dict) -> str:
    """Every table of ``summary`` as aligned plain text, RULER's averages first, then one table per task."""
    effective = {(e["model"], e["task"], e["method"]): e for e in summary["effective_length"]}
    several = len({c["model"] for c in summary["cells"]}) > 1
    blocks = []
    paired = _grouped(summary["ruler_paired"], "model", "family")
    for (model, family), entries in _grouped(summary["ruler"], "model", "family").items():
        title = f"{family} (RULER score: the mean of the task means, %)" + (f" — {model}" if several else "")
        blocks.append(_block(title, entries, paired[model, family], effective, (model, family), decimals=1))
    paired = _grouped(summary["paired"], "model", "task")
    for (model, task), entries in _grouped(summary["cells"], "model", "task").items():
        metric = entries[0].get("metric", "")
        unit = "perplexity, lower is better" if metric == "perplexity" else score_label(metric)
        title = f"{task}: {unit}" + (f" — {model}" if several else "")
        blocks.append(
            _block(
                title,
                entries,
                paired[model, task],
                effective,
                (model, task),
                decimals=2 if metric == "perplexity" else 1,
            )
        )
    if summary.get("failed"):
        blocks.append(f"{summary['failed']} cases failed (summary.md lists them; a rerun retries them).")
    return "\n\n".join(blocks)


def _grouped(entries: list[dict], *keys: str) -> defaultdict:
    """``entries`` in lists by the values of ``keys``, in their order."""
    groups = defaultdict(list)
    for entry in entries:
        groups[tuple(entry[key] for key in keys)].append(entry)
    return groups


def _block(title: str, entries: list[dict], paired: list[dict], effective: dict, where: tuple, decimals: int) -> str:
    """A table with a row per method (score [low, high] n=cases at each length, effective length), then one with
    a row per method minus rope (difference [low, high] on n pairs of the same cases)."""
    lengths = sorted({e["length"] for e in entries})
    methods = list(dict.fromkeys(e["method"] for e in entries))
    by_cell = {(e["method"], e["length"]): e for e in entries}
    with_effective = any(where + (m,) in effective for m in methods)
    rows = [["method", *map(length_text, lengths), *(["effective length"] if with_effective else [])]]
    for method in methods:
        texts = [_score(by_cell[method, n], decimals) if (method, n) in by_cell else "—" for n in lengths]
        rows.append(
            [method_name(method), *texts, *([_effective(effective.get(where + (method,)))] if with_effective else [])]
        )
    text = f"{title}\n{_aligned(rows)}"
    if paired:
        differences = {(p["method"], p["length"]): p for p in paired}
        rows = [[f"minus {paired[0]['minus']}, same cases", *map(length_text, lengths)]]
        rows += [
            [method_name(method), *(_difference(differences.get((method, n))) for n in lengths)]
            for method in dict.fromkeys(p["method"] for p in paired)
        ]
        text += f"\n\n{_aligned(rows)}"
    return text


def _score(entry: dict, decimals: int) -> str:
    """``34.0 [22, 48] n=50``; a RULER average over a set of tasks that is not RULER's says so."""
    n = entry.get("n", entry.get("cases"))
    interval = "" if entry.get("low") is None else f" [{entry['low']:.0f}, {entry['high']:.0f}]"
    return f"{entry['score']:.{decimals}f}{interval} n={n}" + (" incomplete" if entry.get("complete") is False else "")


def _difference(entry: dict | None) -> str:
    if not entry or not entry["n"] or entry["difference"] is None:
        return "—"
    interval = "" if entry["low"] is None else f" [{entry['low']:+.0f}, {entry['high']:+.0f}]"
    return f"{entry['difference']:+.1f}{interval} n={entry['n']}"


def _effective(entry: dict | None) -> str:
    return effective_text(entry) if entry else "—"


def _aligned(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(text.ljust(width) for text, width in zip(row, widths, strict=True)).rstrip() for row in rows
    )

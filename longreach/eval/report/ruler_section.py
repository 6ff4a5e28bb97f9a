"""The report's RULER tables: per packing, RULER's score per length -- the mean of the task means, as RULER's
tables -- with its stratified bootstrap interval, Avg. and weighted averages, and the effective length on it."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from statistics import mean

from ...plots import length_text
from .. import ruler, stats
from . import pictures
from .cells import (
    BASELINE,
    baseline_of,
    bounds,
    difference,
    differences,
    effective_lengths,
    effective_text,
    number,
    paired_record,
)

RULER_FAMILIES = {"ruler": "RULER", "ruler-tight": "RULER, packed tight"}  # ruler:* and ruler-tight:* get a table each
RULER_WITHOUT_QA = [name for name in ruler.TASKS if not name.startswith("qa")]


def ruler_section(out: Path, model: str, family: str, rows: list[dict], threshold: float, summary: dict) -> str:
    """RULER's table for one packing (``family``: ``ruler`` or ``ruler-tight``): per method and length the
    mean of the task means (13 tasks; 11 without QA, marked), its stratified bootstrap interval, Avg. /
    wAvg (inc) / wAvg (dec) and the effective length on it."""
    methods = list(dict.fromkeys(r["method"] for r in rows))
    lengths = sorted({r["length"] for r in rows})
    by_case = defaultdict(lambda: defaultdict(dict))  # (method, length) -> task -> (depth, seed) -> score
    for r in rows:
        by_case[r["method"], r["length"]][r["task"]][r["depth"], r["seed"]] = r["score"]
    source = (
        f"Reproduces {ruler.REVISION}."
        if family == "ruler"
        else f"{ruler.REVISION}'s tasks, each case's haystack as "
        "large as fits (not RULER's sizing, whose cases are shorter: not comparable with published RULER tables)."
    )
    lines = [
        f"## {RULER_FAMILIES[family]}{' — ' + model if model else ''}\n",
        f"{source} The RULER score of a length is the mean of its task means (13 tasks; "
        "'11 tasks' marks a run without QA data, not comparable with 13-task tables; any other set of tasks is marked "
        "incomplete and left out of the averages; [?]: one case per task leaves no interval).\n",
        "| method | "
        + " | ".join(length_text(n) for n in lengths)
        + " | Avg. | wAvg (inc) | wAvg (dec) | effective length |",
        "|---" * (len(lengths) + 5) + "|",
    ]
    series: dict[str, dict] = {}
    by_interval: dict[tuple[str, int], tuple[float, float]] = {}
    for method in methods:
        line, series[method], intervals = _score_row(
            method, lengths, by_case, rows[0]["model"], family, threshold, summary
        )
        lines.append(line)
        by_interval.update({(method, n): interval for n, interval in intervals.items()})
    paired: dict[str, dict] = {}
    if baselines := baseline_of(rows):
        table, paired = _paired_table(baselines, lengths, by_case, series, rows[0]["model"], family, summary)
        lines += table
    if any(series.values()):
        picture = pictures.compare(
            out,
            f"{family}{'_' + model if model else ''}",
            f"{RULER_FAMILIES[family]}{' — ' + model if model else ''}",
            {m: (list(c), [s for s, _ in c.values()]) for m, c in series.items() if c},
            {m: [by_interval[m, n] for n in c] for m, c in series.items() if c},
            differences(paired),
            "ruler",
            threshold,
            rows[0]["window"],
            BASELINE,
        )
        lines.append(f"\n![RULER]({picture.name})")
    empty = defaultdict(int)
    for r in rows:
        empty[r["task"]] += bool(r.get("empty"))
    lines.append(
        "\nEmpty answers per task (RULER's 'Nulls'): "
        + ", ".join(f"{t.split(':')[1]} {empty[t]}" for t in sorted(empty))
        + "."
    )
    return "\n".join(lines) + "\n"


def _score_row(
    method: str, lengths: list[int], by_case: dict, model: str, family: str, threshold: float, summary: dict
) -> tuple[str, dict[int, tuple[float, float]], dict[int, tuple[float, float]]]:
    """``method``'s row of the table: per length the RULER score with its interval, then Avg., the weighted
    averages and the effective length, each appended to ``summary``. Also, at the lengths with a complete set of
    tasks (13, or 11 without QA), ``(score, low)`` and the interval ``(low, high)``."""
    complete, intervals, texts = {}, {}, []
    for n in lengths:
        groups = {task: list(scores.values()) for task, scores in by_case[method, n].items()}
        if not groups:
            texts.append("—")
            continue
        score = mean(mean(g) for g in groups.values())
        low, high = stats.bootstrap(list(groups.values()))
        names = {task.split(":", 1)[1] for task in groups}
        kind = "13" if names == set(ruler.TASKS) else "11" if names == set(RULER_WITHOUT_QA) else "incomplete"
        cases = sum(len(g) for g in groups.values())
        summary["ruler"].append(
            {
                "model": model,
                "family": family,
                "method": method,
                "length": n,
                "score": score,
                "low": number(low),
                "high": number(high),
                "tasks": sorted(groups),
                "cases": cases,
                "complete": kind != "incomplete",
            }
        )
        label = {"13": "", "11": "11 tasks, "}.get(kind, f"{len(groups)} tasks, incomplete, ")
        texts.append(f"{score:.1f} {bounds((low, high))} ({label}n={cases})")
        if kind != "incomplete":
            complete[n], intervals[n] = (score, low), (low, high)
    averages = stats.weighted_averages({n: s for n, (s, _) in complete.items()}) if complete else None
    effective = effective_lengths(complete, threshold)
    summary["effective_length"].append(
        {"model": model, "task": family, "method": method, **effective, **(averages or {})}
    )
    tail = " | ".join(f"{averages[k]:.1f}" for k in ("avg", "wavg_inc", "wavg_dec")) if averages else "— | — | —"
    return f"| {method} | " + " | ".join(texts) + f" | {tail} | {effective_text(effective)} |", complete, intervals


def _paired_table(
    baselines: dict[str, str],
    lengths: list[int],
    by_case: dict,
    series: dict[str, dict],
    model: str,
    family: str,
    summary: dict,
) -> tuple[list[str], dict[str, dict]]:
    """The table of each method minus its baseline (appended to ``summary``), and ``paired[method][length] =
    (difference, interval)`` where there are pairs and a score in ``series``."""
    paired: defaultdict[str, dict] = defaultdict(dict)
    lines = [
        "",
        f"Minus {BASELINE} on the same cases (the mean over tasks of each task's mean paired difference; "
        "bootstrap interval resampling each task's pairs; pairs):",
        "",
        "| method | " + " | ".join(length_text(n) for n in lengths) + " |",
        "|---" * (len(lengths) + 1) + "|",
    ]
    for method, baseline in baselines.items():
        texts = []
        for n in lengths:
            value, (low, high), pairs = stats.paired_average(by_case[method, n], by_case[baseline, n])
            where = {"model": model, "family": family}
            summary["ruler_paired"].append(paired_record(where, method, baseline, n, value, (low, high), pairs))
            tasks = len(by_case[method, n])  # fewer than 13: a partial average, marked as in the scores' table
            texts.append(
                (difference(value, (low, high), pairs) + ("" if tasks == len(ruler.TASKS) else f" ({tasks} tasks)"))
                if pairs
                else "—"
            )
            if pairs and n in series[method]:  # pictured where the score is: a complete set of tasks
                paired[method][n] = (value, (low, high))
        lines.append(f"| {method} | " + " | ".join(texts) + " |")
    return lines, paired

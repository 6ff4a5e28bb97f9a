"""Reports rebuilt from the JSONL alone: summary.md, summary.json, comparison plots with intervals, heatmaps.

Every score comes with its n and its 95% interval (:mod:`.stats`). RULER tasks add one RULER score
per length -- the mean of the task means, as RULER's tables -- with its Avg., weighted averages and
an effective length computed on it.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from statistics import mean

from .. import provenance
from ..plots import length_text
from . import pictures, prompt_sizes, ruler, stats, summary_csv, tasks
from .records import RESULTS, read_results
from .report_runs import errors_section, runs_section, seconds_by_batch, time_section

RULER_THRESHOLD = stats.RULER_THRESHOLD
RULER_FAMILIES = {"ruler": "RULER", "ruler-tight": "RULER, packed tight"}  # ruler:* and ruler-tight:* get a table each
RULER_TASKS = [f"ruler:{name}" for name in ruler.TASKS]
RULER_WITHOUT_QA = [name for name in ruler.TASKS if not name.startswith("qa")]
effective_length = stats.effective_length
BASELINE = "rope"  # every other method's paired difference is taken against it


@dataclass
class Cell:
    """The cases of one (model, task, method, length)."""

    rows: list[dict]

    @property
    def scores(self) -> list[float]:
        return [r["score"] for r in self.rows]

    @property
    def n(self) -> int:
        return len(self.rows)

    @property
    def score(self) -> float:
        return mean(self.scores)

    @property
    def interval(self) -> tuple[float, float]:
        return stats.interval(self.scores)

    @property
    def by_case(self) -> dict[tuple, float]:
        """Scores keyed by (depth, seed): the same key is the same prompt under another method."""
        return {(r["depth"], r["seed"]): r["score"] for r in self.rows}

    @property
    def empty(self) -> int:
        return sum(bool(r.get("empty")) for r in self.rows)

    def text(self) -> str:
        return f"{self.score:.1f} {bounds(self.interval)} n={self.n}"


def bounds(interval: tuple[float, float]) -> str:
    """``[low, high]``, or ``[?]`` where one case per group leaves no interval."""
    low, high = interval
    return "[?]" if math.isnan(low) else f"[{low:.0f}, {high:.0f}]"


def difference(value: float, interval: tuple[float, float], n: int) -> str:
    """``+12.5 [+0, +25] (n=4)``: a paired difference with its interval and number of pairs."""
    if not n:
        return "no common cases"
    low, high = ("?", "?") if math.isnan(interval[0]) else (f"{interval[0]:+.0f}", f"{interval[1]:+.0f}")
    return f"{value:+.1f} [{low}, {high}] (n={n})"


def _number(value: float) -> float | None:
    """JSON has no NaN: a missing interval bound is null."""
    return None if isinstance(value, float) and math.isnan(value) else value


def build(out: Path, threshold: float = RULER_THRESHOLD) -> str:
    """Write ``summary.md``, ``summary.json``, ``summary.csv`` and the plots of a results folder (what
    ``longreach report`` does).

    Args:
        out: the results folder; its ``results.jsonl`` is read.
        threshold: the score an effective length must reach at every length up to it (RULER's 85.6).

    Returns:
        The markdown of ``summary.md``.
    """
    records = read_results(out / RESULTS)
    if not records:
        raise ValueError(f"no results in {out / RESULTS}")
    failed = [r for r in records if r.get("error")]
    records = _model_names(_row_labels([r for r in records if not r.get("error")]))
    if not records:
        raise ValueError(f"every case in {out / RESULTS} failed; the first: {failed[0]['error']}")
    models = sorted({r["model"] for r in records})
    by_task = defaultdict(list)
    for r in records:
        by_task[r["model"], r["task"]].append(r)
    runs = provenance.read(out)
    resolved = {run["model"]: run.get("model_name") for run in runs}
    summary = {
        "threshold": threshold,
        "confidence": stats.CONFIDENCE,
        "cells": [],
        "paired": [],
        "effective_length": [],
        "ruler": [],
        "ruler_paired": [],
        "sizes": prompt_sizes.sizes(records),
        "failed": len(failed),
        "runs": runs,
    }
    names = ", ".join(f"{m} = {resolved[m]}" if resolved.get(m) and resolved[m] != m else m for m in models)
    sections = [
        f"# longreach results\n\nModel: {names}; {len(records)} cases; every score is the mean "
        f"with its 95% interval [low, high] and n (Wilson for pass/fail, bootstrap for means); effective length "
        f"threshold {threshold:g}.\n"
    ]
    for model in models:
        for family in RULER_FAMILIES:
            rows = [r for (m, task), rs in by_task.items() if m == model and task.split(":")[0] == family for r in rs]
            if rows:
                sections.append(_ruler_section(out, model if len(models) > 1 else "", family, rows, threshold, summary))
    for (model, task), rows in sorted(by_task.items()):
        title = task if len(models) == 1 else f"{task} — {model}"
        sections.append(_task_section(out, title, rows, threshold, summary))
    sections.append(prompt_sizes.section(summary["sizes"], length_text))
    sections.append(time_section(records))
    if failed:
        sections.append(errors_section(failed))
    sections.append(runs_section(runs))
    markdown = "\n".join(sections)
    pictures.remove_stale(out, markdown)
    (out / "summary.md").write_text(markdown, encoding="utf-8")
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    summary_csv.write(out / summary_csv.NAME, summary)
    return markdown


def _cells(rows: list[dict]) -> dict[tuple[str, int], Cell]:
    cells = defaultdict(list)
    for r in rows:
        cells[r["method"], r["length"]].append(r)
    return {key: Cell(value) for key, value in cells.items()}


def _effective(by_length: dict[int, Cell], threshold: float) -> dict:
    """Effective length by the point estimates and by the intervals' lower bounds (the sure one)."""
    return {
        "point": effective_length({n: c.score for n, c in by_length.items()}, threshold),
        "sure": effective_length({n: c.interval[0] for n, c in by_length.items()}, threshold),
    }


def _fmt_effective(effective: dict) -> str:
    if effective["point"] is None:  # no complete length to read it on
        return "—"

    def name(n):
        return length_text(n) if n else "none"

    return f"{name(effective['point'])} (sure: {name(effective['sure'])})"


def _task_section(out: Path, task: str, rows: list[dict], threshold: float, summary: dict) -> str:
    perplexity = rows[0]["metric"] == "perplexity"
    methods = list(dict.fromkeys(r["method"] for r in rows))
    lengths = sorted({r["length"] for r in rows})
    cells = _cells(rows)
    name = rows[0]["task"]
    header = "| method | " + " | ".join(length_text(n) for n in lengths) + " |"
    lines = [f"## {task}\n"]
    if source := tasks.revision(name):
        lines.append(
            f"Reproduces {source}; {rows[0].get('max_new_tokens', '?')} tokens to generate, inside the length.\n"
        )
    if perplexity:
        lines += [
            "Perplexity / mean log-perplexity (nats per token); lower is better.\n",
            header,
            "|---" * (len(lengths) + 1) + "|",
        ]
    else:
        lines += [header + " effective length |", "|---" * (len(lengths) + 2) + "|"]
    series = {}
    for method in methods:
        mine = {n: cells[method, n] for n in lengths if (method, n) in cells}
        for n, cell in mine.items():
            low, high = cell.interval
            summary["cells"].append(
                {
                    "model": rows[0]["model"],
                    "task": name,
                    "method": method,
                    "length": n,
                    "n": cell.n,
                    "metric": cell.rows[0]["metric"],
                    "score": cell.score,
                    "low": _number(low),
                    "high": _number(high),
                    "empty": cell.empty,
                    "seconds_per_case": seconds_by_batch(cell.rows),
                    "machines": sorted({r.get("machine", "not recorded") for r in cell.rows}),
                }
            )
        if perplexity:
            logs = {n: mean(r["log_ppl"] for r in c.rows) for n, c in mine.items()}
            row = " | ".join(
                f"{mine[n].score:.2f} / {logs[n]:.4f} (n={mine[n].n})" if n in mine else "—" for n in lengths
            )
            lines.append(f"| {method} | {row} |")
        else:
            effective = _effective(mine, threshold)
            summary["effective_length"].append({"model": rows[0]["model"], "task": name, "method": method, **effective})
            row = " | ".join(mine[n].text() if n in mine else "—" for n in lengths)
            lines.append(f"| {method} | {row} | {_fmt_effective(effective)} |")
        series[method] = (list(mine), [c.score for c in mine.values()], [c.interval for c in mine.values()])
    baselines, paired = _baselines(rows), defaultdict(dict)
    if not perplexity and baselines:
        lines += [
            "",
            f"Minus {BASELINE} on the same cases (mean paired difference, bootstrap interval over the pairs, pairs):",
            "",
            header,
            "|---" * (len(lengths) + 1) + "|",
        ]
        for method, baseline in baselines.items():
            texts = []
            for n in lengths:
                value, (low, high), pairs = stats.paired_difference(
                    *(cells[m, n].by_case if (m, n) in cells else {} for m in (method, baseline))
                )
                summary["paired"].append(
                    {
                        "model": rows[0]["model"],
                        "task": name,
                        "method": method,
                        "minus": baseline,
                        "length": n,
                        "difference": _number(value),
                        "low": _number(low),
                        "high": _number(high),
                        "n": pairs,
                    }
                )
                texts.append(difference(value, (low, high), pairs) if pairs else "—")
                if pairs:
                    paired[method][n] = (value, (low, high))
            lines.append(f"| {method} | " + " | ".join(texts) + " |")
    if any("fraction" in r for r in rows):
        lines += [
            "",
            "Fraction of the needles found (mean, bootstrap interval):",
            "",
            header,
            "|---" * (len(lengths) + 1) + "|",
        ]
        for method in methods:
            texts = []
            for n in lengths:
                fractions = (
                    [100 * r["fraction"] for r in cells[method, n].rows if "fraction" in r]
                    if (method, n) in cells
                    else []
                )
                texts.append(f"{mean(fractions):.1f} {bounds(stats.bootstrap([fractions]))}" if fractions else "—")
            lines.append(f"| {method} | " + " | ".join(texts) + " |")
    empty = sum(c.empty for c in cells.values())
    if not perplexity:
        lines.append(f"\nEmpty answers: {empty} of {len(rows)}.")
    window = rows[0].get("window")
    if perplexity:
        picture = pictures.perplexity(out, task, {m: s[:2] for m, s in series.items()}, window)
    else:
        picture = pictures.compare(
            out,
            task,
            task,
            {m: s[:2] for m, s in series.items()},
            {m: s[2] for m, s in series.items()},
            _differences(paired),
            rows[0]["metric"],
            threshold,
            window,
            BASELINE,
        )
    lines += ["", f"![{task}]({picture.name})"]
    if perplexity:
        lines.append(f"![{task} by position]({pictures.loss_by_position(out, task, rows, methods, window).name})")
    for method in methods:
        heat = pictures.heatmap(out, task, method, [r for r in rows if r["method"] == method], lengths)
        if heat:
            lines.append(f"![{task} {method}]({heat.name})")
    return "\n".join(lines) + "\n"


def _ruler_section(out: Path, model: str, family: str, rows: list[dict], threshold: float, summary: dict) -> str:
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
    series, by_interval = {}, {}
    for method in methods:
        complete, texts = {}, []
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
                    "model": rows[0]["model"],
                    "family": family,
                    "method": method,
                    "length": n,
                    "score": score,
                    "low": _number(low),
                    "high": _number(high),
                    "tasks": sorted(groups),
                    "cases": cases,
                    "complete": kind != "incomplete",
                }
            )
            label = {"13": "", "11": "11 tasks, "}.get(kind, f"{len(groups)} tasks, incomplete, ")
            texts.append(f"{score:.1f} {bounds((low, high))} ({label}n={cases})")
            if kind != "incomplete":
                complete[n], by_interval[method, n] = (score, low), (low, high)
        averages = stats.weighted_averages({n: s for n, (s, _) in complete.items()}) if complete else None
        effective = {
            "point": effective_length({n: s for n, (s, _) in complete.items()}, threshold) if complete else None,
            "sure": effective_length({n: low for n, (_, low) in complete.items()}, threshold) if complete else None,
        }
        summary["effective_length"].append(
            {"model": rows[0]["model"], "task": family, "method": method, **effective, **(averages or {})}
        )
        series[method] = complete
        tail = " | ".join(f"{averages[k]:.1f}" for k in ("avg", "wavg_inc", "wavg_dec")) if averages else "— | — | —"
        lines.append(f"| {method} | " + " | ".join(texts) + f" | {tail} | {_fmt_effective(effective)} |")
    paired = defaultdict(dict)
    if baselines := _baselines(rows):
        lines += [
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
                summary["ruler_paired"].append(
                    {
                        "model": rows[0]["model"],
                        "family": family,
                        "method": method,
                        "minus": baseline,
                        "length": n,
                        "difference": _number(value),
                        "low": _number(low),
                        "high": _number(high),
                        "n": pairs,
                    }
                )
                tasks = len(by_case[method, n])  # fewer than 13: a partial average, marked as in the scores' table
                texts.append(
                    (difference(value, (low, high), pairs) + ("" if tasks == len(ruler.TASKS) else f" ({tasks} tasks)"))
                    if pairs
                    else "—"
                )
                if pairs and n in series[method]:  # pictured where the score is: a complete set of tasks
                    paired[method][n] = (value, (low, high))
            lines.append(f"| {method} | " + " | ".join(texts) + " |")
    if any(series.values()):
        picture = pictures.compare(
            out,
            f"{family}{'_' + model if model else ''}",
            f"{RULER_FAMILIES[family]}{' — ' + model if model else ''}",
            {m: (list(c), [s for s, _ in c.values()]) for m, c in series.items() if c},
            {m: [by_interval[m, n] for n in c] for m, c in series.items() if c},
            _differences(paired),
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


def _differences(paired: dict[str, dict[int, tuple]]) -> dict[str, tuple[list, list, list]]:
    """``paired[method][length] = (difference, interval)`` as the picture's ``(lengths, differences, intervals)`` per
    method."""
    return {
        method: (list(by_length), [v for v, _ in by_length.values()], [i for _, i in by_length.values()])
        for method, by_length in paired.items()
        if by_length
    }


def _baselines(rows: list[dict]) -> dict[str, str]:
    """Each row's baseline: the ``rope`` row run with the same ``L`` (a folder may hold rope at two windows,
    each labelled with its resolution); rows whose ``L`` has no rope row are left out."""

    def is_rope(r):
        return r["resolved"] == BASELINE or r["resolved"].startswith(f"{BASELINE} [")

    rope = {r.get("window"): r["method"] for r in rows if is_rope(r)}
    pairs = {r["method"]: rope.get(r.get("window")) for r in rows if not is_rope(r)}
    return {method: baseline for method, baseline in pairs.items() if baseline is not None}


def _row_labels(records: list[dict]) -> list[dict]:
    """Records with ``method`` set to the row they belong to: the label as given, with the resolved
    method beside it where one label stands for several (another L, another model's defaults)."""
    meanings = defaultdict(set)
    for r in records:
        meanings[r["method"]].add(r["resolved"])
    return [
        {**r, "method": r["method"] if len(meanings[r["method"]]) == 1 else f"{r['method']} = {r['resolved']}"}
        for r in records
    ]


def _model_names(records: list[dict]) -> list[dict]:
    """One model per identity (``model_key``): two names of one folder (``tiny``, ``tiny/``) are one model,
    shown by the first; one name over two identities (its weights overwritten) is two, told apart by digest."""
    first, identities = {}, defaultdict(set)
    for r in records:
        key = r.get("model_key") or r["model"]
        first.setdefault(key, r["model"])
        identities[first[key]].add(key)

    def name(r: dict) -> str:
        key = r.get("model_key") or r["model"]
        shown = first[key]
        return shown if len(identities[shown]) == 1 else f"{shown} @{key.rpartition('@')[2][:8]}"

    return [{**r, "model": name(r)} for r in records]

"""Reports rebuilt from the JSONL alone: summary.md, summary.json, comparison plots with intervals, heatmaps.

Every score comes with its n and its 95% interval (:mod:`..stats`). RULER tasks add one RULER score
per length -- the mean of the task means, as RULER's tables -- with its Avg., weighted averages and
an effective length computed on it.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from statistics import mean

from ... import provenance
from ...plots import length_text
from .. import infbench, prompt_sizes, ruler, stats, tasks
from ..records import RESULTS, read_results
from . import pictures, summary_csv
from .cells import (
    BASELINE,
    baseline_of,
    bounds,
    difference,
    differences,
    effective_lengths,
    effective_text,
    group_cells,
    number,
    paired_record,
)
from .infbench_section import infbench_section
from .ruler_section import RULER_FAMILIES, ruler_section
from .run_sections import errors_section, runs_section, seconds_by_batch, time_section

RULER_THRESHOLD = stats.RULER_THRESHOLD
RULER_TASKS = [f"ruler:{name}" for name in ruler.TASKS]


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
        "infbench": [],
        "sizes": prompt_sizes.sizes(records),
        "failed": len(failed),
        "runs": runs,
    }
    names = ", ".join(f"{m} = {resolved[m]}" if resolved.get(m) and resolved[m] != m else m for m in models)
    sections = [
        f"# longreach results\n\nModel: {names}; {len(records)} cases; every score is the mean "
        f"with its 95% interval [low, high] and n (Wilson for pass/fail, bootstrap for means); effective length "
        f"by RULER's threshold {threshold:g}, and relative: 85% of the score at the shortest length (NoLiMa's).\n"
    ]
    for model in models:
        sections += _family_sections(out, model, model if len(models) > 1 else "", by_task, threshold, summary)
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


def _family_sections(out: Path, model: str, shown: str, by_task: dict, threshold: float, summary: dict) -> list[str]:
    """``model``'s RULER tables (one per packing) and InfiniteBench tables (one per family), titled with ``shown``
    (empty for a folder of one model)."""
    sections = []
    for family in RULER_FAMILIES:
        if rows := _family_rows(by_task, model, family):
            sections.append(ruler_section(out, shown, family, rows, threshold, summary))
    for family in infbench.FAMILIES:
        if rows := _family_rows(by_task, model, family):
            sections.append(infbench_section(shown, family, rows, summary))
    return sections


def _family_rows(by_task: dict, model: str, family: str) -> list[dict]:
    return [r for (m, task), rs in by_task.items() if m == model and task.split(":")[0] == family for r in rs]


def _task_section(out: Path, task: str, rows: list[dict], threshold: float, summary: dict) -> str:
    perplexity = rows[0]["metric"] == "perplexity"
    methods = list(dict.fromkeys(r["method"] for r in rows))
    lengths = sorted({r["length"] for r in rows})
    cells = group_cells(rows)
    header = "| method | " + " | ".join(length_text(n) for n in lengths) + " |"
    lines = [f"## {task}\n"]
    if source := tasks.revision(rows[0]["task"]):
        lines.append(
            f"Reproduces {source}; {rows[0].get('max_new_tokens', '?')} tokens to generate, inside the length.\n"
        )
    table, series = _score_table(rows, methods, lengths, cells, header, threshold, summary)
    lines += table
    paired: dict[str, dict] = {}
    if not perplexity and (baselines := baseline_of(rows)):
        table, paired = _paired_table(rows, baselines, lengths, cells, header, summary)
        lines += table
    if any("fraction" in r for r in rows):
        lines += _fraction_table(methods, lengths, cells, header)
    if not perplexity:
        lines.append(f"\nEmpty answers: {sum(c.empty for c in cells.values())} of {len(rows)}.")
    lines += _task_pictures(out, task, rows, methods, lengths, series, paired, threshold)
    return "\n".join(lines) + "\n"


def _score_table(
    rows: list[dict],
    methods: list[str],
    lengths: list[int],
    cells: dict,
    header: str,
    threshold: float,
    summary: dict,
) -> tuple[list[str], dict[str, tuple[list, list, list]]]:
    """The table of the task's scores per method and length (perplexity: with the mean log-perplexity; otherwise
    with the effective length), the cells appended to ``summary``, and each method's ``(lengths, scores,
    intervals)``."""
    perplexity = rows[0]["metric"] == "perplexity"
    model, name = rows[0]["model"], rows[0]["task"]
    if perplexity:
        lines = [
            "Perplexity / mean log-perplexity (nats per token); lower is better.\n",
            header,
            "|---" * (len(lengths) + 1) + "|",
        ]
    else:
        lines = [header + " effective length |", "|---" * (len(lengths) + 2) + "|"]
    series = {}
    for method in methods:
        mine = {n: cells[method, n] for n in lengths if (method, n) in cells}
        for n, cell in mine.items():
            low, high = cell.interval
            summary["cells"].append(
                {
                    "model": model,
                    "task": name,
                    "method": method,
                    "length": n,
                    "n": cell.n,
                    "metric": cell.rows[0]["metric"],
                    "score": cell.score,
                    "low": number(low),
                    "high": number(high),
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
            effective = effective_lengths({n: (c.score, c.interval[0]) for n, c in mine.items()}, threshold)
            summary["effective_length"].append({"model": model, "task": name, "method": method, **effective})
            row = " | ".join(mine[n].text() if n in mine else "—" for n in lengths)
            lines.append(f"| {method} | {row} | {effective_text(effective)} |")
        series[method] = (list(mine), [c.score for c in mine.values()], [c.interval for c in mine.values()])
    return lines, series


def _paired_table(
    rows: list[dict],
    baselines: dict[str, str],
    lengths: list[int],
    cells: dict,
    header: str,
    summary: dict,
) -> tuple[list[str], dict[str, dict]]:
    """The table of each method minus its baseline on the same cases, per length (appended to ``summary``), and
    ``paired[method][length] = (difference, interval)`` where there are pairs."""
    paired: defaultdict[str, dict] = defaultdict(dict)
    lines = [
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
            where = {"model": rows[0]["model"], "task": rows[0]["task"]}
            summary["paired"].append(paired_record(where, method, baseline, n, value, (low, high), pairs))
            texts.append(difference(value, (low, high), pairs) if pairs else "—")
            if pairs:
                paired[method][n] = (value, (low, high))
        lines.append(f"| {method} | " + " | ".join(texts) + " |")
    return lines, paired


def _fraction_table(methods: list[str], lengths: list[int], cells: dict, header: str) -> list[str]:
    """The table of the fraction of the needles found per method and length."""
    lines = [
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
                [100 * r["fraction"] for r in cells[method, n].rows if "fraction" in r] if (method, n) in cells else []
            )
            texts.append(f"{mean(fractions):.1f} {bounds(stats.bootstrap([fractions]))}" if fractions else "—")
        lines.append(f"| {method} | " + " | ".join(texts) + " |")
    return lines


def _task_pictures(
    out: Path,
    task: str,
    rows: list[dict],
    methods: list[str],
    lengths: list[int],
    series: dict,
    paired: dict[str, dict],
    threshold: float,
) -> list[str]:
    """The task's pictures (written into ``out``) as markdown lines: the scores by length (perplexity: and the loss
    by position), a heatmap per method where the rows have depths."""
    perplexity, window = rows[0]["metric"] == "perplexity", rows[0].get("window")
    if perplexity:
        picture = pictures.perplexity(out, task, {m: s[:2] for m, s in series.items()}, window)
    else:
        picture = pictures.compare(
            out,
            task,
            task,
            {m: s[:2] for m, s in series.items()},
            {m: s[2] for m, s in series.items()},
            differences(paired),
            rows[0]["metric"],
            threshold,
            window,
            BASELINE,
        )
    lines = ["", f"![{task}]({picture.name})"]
    if perplexity:
        lines.append(f"![{task} by position]({pictures.loss_by_position(out, task, rows, methods, window).name})")
    for method in methods:
        heat = pictures.heatmap(out, task, method, [r for r in rows if r["method"] == method], lengths)
        if heat:
            lines.append(f"![{task} {method}]({heat.name})")
    return lines


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

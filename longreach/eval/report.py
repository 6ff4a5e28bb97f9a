"""Reports rebuilt from the JSONL alone: markdown summary, effective lengths, heatmaps, comparison plots."""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path
from statistics import mean

import numpy as np

from .. import plots
from .runner import RESULTS, read_results

RULER_THRESHOLD = 85.6  # RULER: Llama2-7B (4K) average at 4K


def effective_length(scores: dict[int, float], threshold: float = RULER_THRESHOLD) -> int:
    """The largest tested length L' whose score, and that of every shorter tested length, reaches ``threshold``; 0 if none."""
    best = 0
    for length in sorted(scores):
        if scores[length] < threshold:
            break
        best = length
    return best


def _fmt_length(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_")


def build(out: Path, threshold: float = RULER_THRESHOLD) -> str:
    """Write ``summary.md`` and the PNGs in ``out`` from ``out/results.jsonl``; return the markdown."""
    records = read_results(out / RESULTS)
    if not records:
        raise ValueError(f"no results in {out / RESULTS}")
    failed = [r for r in records if r.get("error")]
    records = _row_labels([r for r in records if not r.get("error")])
    if not records:
        raise ValueError(f"every case in {out / RESULTS} failed; the first: {failed[0]['error']}")
    models = sorted({r["model"] for r in records})
    by_task = defaultdict(list)
    for r in records:
        by_task[r["model"], r["task"]].append(r)
    sections = [f"# longreach results\n\nModel: {', '.join(models)}; "
                f"{len(records)} cases; effective length threshold {threshold:g}.\n"]
    for (model, task), rows in sorted(by_task.items()):
        title = task if len(models) == 1 else f"{task} — {model}"
        sections.append(_task_section(out, title, rows, threshold))
    if failed:
        sections.append(_errors_section(failed))
    markdown = "\n".join(sections)
    (out / "summary.md").write_text(markdown, encoding="utf-8")
    return markdown


def _errors_section(failed: list[dict]) -> str:
    """Cases that raised: counted per task, length and method, with the first message; a rerun retries them."""
    groups = defaultdict(list)
    for r in failed:
        groups[r["task"], r["length"], r["method"]].append(r["error"])
    lines = [f"## Failed cases\n\n{len(failed)} cases raised an error and are not in the tables above "
             "(rerun the same command to retry them).\n", "| task | length | method | cases | first error |", "|---|---|---|---|---|"]
    lines += [f"| {task} | {_fmt_length(length)} | {method} | {len(errors)} | {errors[0][:200]} |"
              for (task, length, method), errors in sorted(groups.items())]
    return "\n".join(lines) + "\n"


def _row_labels(records: list[dict]) -> list[dict]:
    """Records with ``method`` set to the row they belong to: the label as given, with the resolved
    method beside it where one label stands for several (another L, another model's defaults)."""
    meanings = defaultdict(set)
    for r in records:
        meanings[r["method"]].add(r["resolved"])
    return [{**r, "method": r["method"] if len(meanings[r["method"]]) == 1 else f"{r['method']} = {r['resolved']}"} for r in records]


def _task_section(out: Path, task: str, rows: list[dict], threshold: float) -> str:
    perplexity = rows[0]["metric"] == "perplexity"
    methods = list(dict.fromkeys(r["method"] for r in rows))
    lengths = sorted({r["length"] for r in rows})
    cell = defaultdict(list)
    for r in rows:
        cell[r["method"], r["length"]].append(r["score"])
    header = "| method | " + " | ".join(_fmt_length(n) for n in lengths) + " |"
    lines = [f"## {task}\n"]
    if perplexity:
        lines += ["Perplexity / mean log-perplexity (nats per token); lower is better.\n", header, "|---" * (len(lengths) + 1) + "|"]
    else:
        lines += [header + " effective length |", "|---" * (len(lengths) + 2) + "|"]
    series, effective = {}, {}
    for method in methods:
        means = {n: mean(cell[method, n]) for n in lengths if cell[method, n]}
        counts = {n: len(cell[method, n]) for n in lengths}
        if perplexity:
            logs = {n: mean(r["log_ppl"] for r in rows if r["method"] == method and r["length"] == n) for n in means}
            row = " | ".join(f"{means[n]:.2f} / {logs[n]:.4f} (n={counts[n]})" if n in means else "—" for n in lengths)
            lines.append(f"| {method} | {row} |")
        else:
            row = " | ".join(f"{means[n]:.1f} (n={counts[n]})" if n in means else "—" for n in lengths)
            effective[method] = effective_length(means, threshold)
            lines.append(f"| {method} | {row} | {_fmt_length(effective[method]) if effective[method] else 'none'} |")
        series[method] = (list(means), list(means.values()))
    if rows[0]["task"] == "niah4":
        lines += ["", "Fraction of the 4 needles found:", "",
                  "| method | " + " | ".join(_fmt_length(n) for n in lengths) + " |", "|---" * (len(lengths) + 1) + "|"]
        for method in methods:
            fractions = [[100 * r["fraction"] for r in rows if r["method"] == method and r["length"] == n] for n in lengths]
            lines.append(f"| {method} | " + " | ".join(f"{mean(f):.1f}" if f else "—" for f in fractions) + " |")
    window = rows[0].get("window")
    ylabel = "perplexity" if perplexity else "score"
    picture = plots.lines(series, f"{task}: {ylabel} vs length", out / f"compare_{_slug(task)}.png", ylabel=ylabel,
                          threshold=None if perplexity else threshold, marks={"window": window} if window else None,
                          log_y=perplexity)
    lines += ["", f"![{task}]({picture.name})"]
    if perplexity:
        lines.append(f"![{task} by position]({_loss_by_position(out, task, rows, methods, window).name})")
    for method in methods:
        heat = _heatmap(out, task, method, [r for r in rows if r["method"] == method], lengths)
        if heat:
            lines.append(f"![{task} {method}]({heat.name})")
    return "\n".join(lines) + "\n"


def _loss_by_position(out: Path, task: str, rows: list[dict], methods: list[str], window: int | None) -> Path:
    """Mean loss per position bucket at the longest tested length, one line per method."""
    longest = max(r["length"] for r in rows)
    series = {}
    for method in methods:
        mine = [r for r in rows if r["method"] == method and r["length"] == longest]
        if mine:
            edges = mine[0]["bucket_edges"]
            centres = [(a + b) / 2 for a, b in zip(edges[:-1], edges[1:])]
            series[method] = (centres, [mean(values) for values in zip(*(r["bucket_loss"] for r in mine))])
    return plots.lines(series, f"{task}: loss by position at {_fmt_length(longest)} tokens", out / f"loss_by_position_{_slug(task)}.png",
                       ylabel="mean next-token loss (nats)", xlabel="position (tokens)",
                       marks={"window": window} if window and window < longest else None)


def _heatmap(out: Path, task: str, method: str, rows: list[dict], lengths: list[int]) -> Path | None:
    """Score by needle depth x length. Multi-needle cases count each needle at its own depth (quarters)."""
    if all(r["depth"] is not None for r in rows):
        depths = sorted({r["depth"] for r in rows})
        labels = [f"{d:.0%}" for d in depths]
        place = lambda r: [(depths.index(r["depth"]), r["score"])]
    elif all(r.get("found") and len(r["found"]) == len(r.get("needle_depths") or []) for r in rows):
        labels = ["0-25%", "25-50%", "50-75%", "75-100%"]
        place = lambda r: [(min(3, int(d * 4)), 100.0 * f) for d, f in zip(r["needle_depths"], r["found"])]
    else:
        return None
    sums, counts = np.zeros((len(labels), len(lengths))), np.zeros((len(labels), len(lengths)))
    for r in rows:
        for row, value in place(r):
            sums[row, lengths.index(r["length"])] += value
            counts[row, lengths.index(r["length"])] += 1
    with np.errstate(invalid="ignore"):
        grid = sums / counts
    return plots.heatmap(grid, labels, [_fmt_length(n) for n in lengths], f"{task} — {method}",
                         out / f"heatmap_{_slug(task)}_{_slug(method)}.png")

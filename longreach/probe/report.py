"""The probing experiment's report: effective length against tokens seen and against position frequency
(the STRING paper's Figure 2a and 2b in miniature), and accuracy by distance with each method.

Reads training runs (``step_N/state.json``) and their ``measure.json``; writes ``summary.md``,
``summary.json``, the plots and each run's model config into one folder.
"""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import numpy as np

from ..eval import stats
from . import measure
from .train import checkpoints, position_frequency, state_of

BASELINE = "rope"


def build(runs: list[Path], out: Path, threshold: float = stats.RULER_THRESHOLD) -> dict:
    """Write the report of ``runs`` into ``out``; returns what ``summary.json`` holds."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "configs").mkdir(exist_ok=True)
    summary = {"threshold": threshold, "runs": {}}
    for run in runs:
        summary["runs"][run.name] = _run_summary(run, threshold)
        last = checkpoints(run)[-1]
        shutil.copyfile(last / "config.json", out / "configs" / f"{run.name}.json")
    (out / "summary.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")
    (out / "summary.md").write_text(markdown(summary), encoding="utf-8")
    _plots(summary, out)
    return summary


def _run_summary(run: Path, threshold: float) -> dict:
    results = json.loads((run / measure.RESULTS).read_text(encoding="utf-8"))
    states = {str(state["step"]): state for state in map(state_of, checkpoints(run))}
    steps = sorted((s for s in results if s in states), key=int)
    if not steps:
        raise ValueError(f"{run} has no measured checkpoint: run `longreach probe measure {run}` first")
    growth = []
    for step in steps:
        table = _table(results[step]["methods"].get(BASELINE, {}))
        if not table:
            continue
        length = measure.effective_length(table, threshold)
        sure = stats.effective_length({d: row["low"] for d, row in table.items()}, threshold)
        possible = stats.effective_length({d: row["high"] for d, row in table.items()}, threshold)
        f = position_frequency(states[step])
        growth.append(
            {
                "step": int(step),
                "tokens_seen": results[step]["tokens_seen"],
                "effective_length": length,
                "sure_effective_length": sure,
                "possible_effective_length": possible,
                "frequency_at_effective_length": float(f[length]) if length else None,
            }
        )
    final = results[steps[-1]]["methods"]
    window = states[steps[-1]]["corpus"]["window"]
    by_method = {method: _table(rows) for method, rows in final.items()}
    thirds = _thirds(sorted(by_method[BASELINE]), window) if BASELINE in by_method else {}
    differences = {}
    for method, table in by_method.items():
        if method == BASELINE or BASELINE not in by_method:
            continue
        differences[method] = {}
        for band, grid in thirds.items():
            value, (low, high), n = measure.paired_difference(table, by_method[BASELINE], grid)
            differences[method][band] = {"difference": value, "low": low, "high": high, "n": n}
    return {
        "window": window,
        "corpus": states[steps[-1]]["corpus"],
        "final_step": int(steps[-1]),
        "growth": growth,
        "final": {
            m: {str(d): {k: v for k, v in row.items() if k != "cases"} for d, row in t.items()}
            for m, t in by_method.items()
        },
        "minus_rope": differences,
    }


def _table(rows: dict) -> dict[int, dict]:
    return {int(d): row for d, row in rows.items()}


def _thirds(grid: list[int], window: int) -> dict[str, list[int]]:
    """The distances in each third of the window (the last third: the undertrained tail)."""
    edges = [0, window / 3, 2 * window / 3, window]
    names = ["first third", "middle third", "last third"]
    return {
        name: [d for d in grid if lo <= d < hi]
        for name, (lo, hi) in zip(names, itertools.pairwise(edges), strict=True)
        if any(lo <= d < hi for d in grid)
    }


def markdown(summary: dict) -> str:
    lines = [
        "# Probing: effective length follows position frequency",
        "",
        f"Effective length: the largest distance up to which every tested distance's accuracy reaches "
        f"{summary['threshold']} (RULER's rule); *sure* and *possible*: the same on the 95% Wilson lower and upper "
        "bounds, an interval for it.",
        "",
    ]
    for name, run in summary["runs"].items():
        corpus = run["corpus"]
        lines += [
            f"## {name}: {corpus['distribution']} documents, window {run['window']}",
            "",
            "| step | tokens seen | effective length [sure, possible] | f(effective length) |",
            "|---|---|---|---|",
        ]
        for row in run["growth"]:
            f = row["frequency_at_effective_length"]
            lines.append(
                f"| {row['step']} | {row['tokens_seen']:,} | {row['effective_length']} "
                f"[{row['sure_effective_length']}, {row['possible_effective_length']}] | "
                f"{'-' if f is None else f'{f:,.0f}'} |"
            )
        lines += [
            "",
            f"Accuracy by distance at step {run['final_step']} (% [95% interval], n):",
            "",
            "| method | " + " | ".join(next(iter(run["final"].values())).keys()) + " |",
            "|---|" + "---|" * len(next(iter(run["final"].values()))),
        ]
        for method, table in run["final"].items():
            lines.append(
                f"| `{method}` | "
                + " | ".join(
                    f"{r['accuracy']:.0f} [{r['low']:.0f}, {r['high']:.0f}] n={r['n']}" for r in table.values()
                )
                + " |"
            )
        for method, bands in run["minus_rope"].items():
            cells = ", ".join(
                f"{band}: {d['difference']:+.1f} [{d['low']:+.1f}, {d['high']:+.1f}] n={d['n']}"
                for band, d in bands.items()
            )
            lines.append(f"\n`{method}` minus `rope`, the same cases: {cells}")
        lines.append("")
    return "\n".join(lines)


def _plots(summary: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (tokens, frequency) = plt.subplots(1, 2, figsize=(11, 4))
    for name, run in summary["runs"].items():
        rows = run["growth"]
        x = [r["tokens_seen"] for r in rows]
        y, sure = [r["effective_length"] for r in rows], [r["sure_effective_length"] for r in rows]
        (line,) = tokens.plot(x, y, marker="o", label=name)
        tokens.fill_between(x, sure, [r["possible_effective_length"] for r in rows], color=line.get_color(), alpha=0.15)
        measured = [
            (r["frequency_at_effective_length"], r["effective_length"])
            for r in rows
            if r["frequency_at_effective_length"]
        ]
        if measured:
            frequency.plot(*zip(*measured, strict=True), marker="o", color=line.get_color(), label=name)
    tokens.set(
        xlabel="tokens seen",
        ylabel="effective length (tokens)",
        title="effective length vs tokens seen (shaded: sure to possible)",
    )
    frequency.set(
        xscale="log",
        xlabel="f(effective length): occurrences of that distance",
        ylabel="effective length (tokens)",
        title="effective length vs position frequency",
    )
    for axis in (tokens, frequency):
        axis.grid(alpha=0.3)
        if axis.get_legend_handles_labels()[0]:  # no run reached the threshold: nothing drawn against frequency
            axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(out / "effective_length.png", dpi=120)
    plt.close(figure)
    for name, run in summary["runs"].items():
        figure, axis = plt.subplots(figsize=(6, 4))
        for method, table in run["final"].items():
            d = np.array([int(k) for k in table])
            axis.plot(d, [r["accuracy"] for r in table.values()], marker="o", label=method)
            axis.fill_between(d, [r["low"] for r in table.values()], [r["high"] for r in table.values()], alpha=0.15)
        axis.axhline(summary["threshold"], color="grey", linestyle="--", linewidth=0.8)
        axis.set(
            xlabel="distance (tokens)",
            ylabel="retrieval accuracy (%)",
            ylim=(-3, 103),
            title=f"{name}: accuracy by distance, step {run['final_step']}",
        )
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
        figure.tight_layout()
        figure.savefig(out / f"accuracy_{name}.png", dpi=120)
        plt.close(figure)

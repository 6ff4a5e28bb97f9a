"""``longreach tune``: a method's parameters chosen by measurement -- a grid of settings, each run on a task
at one length through the ordinary resumable runner, scored with intervals, the best printed as the
``apply`` line to use.

The table keeps every setting with its n and 95% interval, and names the settings whose interval
overlaps the best one's: at small n these cannot be told apart, and the documentation says so wherever a
"best" setting is quoted.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from statistics import mean

from .. import plots
from ..eval import runner, stats
from ..eval.engines.transformers import Transformers
from ..eval.grid import Grid
from ..eval.report import cells as report_cells
from ..methods.spec import MethodSpec, parse_value


def parse_grid(items: list[str]) -> dict[str, list]:
    """``["shift=1024,2048", "local_window=64"]`` -> ``{"shift": [1024, 2048], "local_window": [64]}``."""
    grid = {}
    for item in items:
        name, sep, values = item.partition("=")
        name = name.strip()
        if not sep or not name or not values.strip(","):
            raise ValueError(f"--grid {item!r} must look like name=value1,value2 (e.g. shift=1024,2048)")
        if name in grid:
            raise ValueError(f"--grid names {name!r} twice; give all its values in one name=value1,value2")
        grid[name] = [parse_value(v.strip()) for v in values.split(",") if v.strip()]
    if not grid:
        raise ValueError("--grid is empty: give e.g. shift=1024,2048 local_window=64,128")
    return grid


def settings(method: str, grid: dict[str, list], fixed: dict | None = None) -> list[MethodSpec]:
    """One method spec per combination of the grid's values (the last parameter varies fastest)."""
    fixed = dict(fixed or {})
    if overlap := sorted(set(fixed) & set(grid)):
        raise ValueError(f"{', '.join(overlap)} is both fixed and in the grid; give it once")
    return [
        MethodSpec(method, tuple(sorted({**fixed, **dict(zip(grid, values, strict=True))}.items())))
        for values in itertools.product(*grid.values())
    ]


@dataclass
class Row:
    """One setting's cases: its label, parameters, and the score of each case by (depth, seed)."""

    label: str
    params: dict
    cases: dict

    @property
    def scores(self) -> list[float]:
        return list(self.cases.values())

    @property
    def n(self) -> int:
        return len(self.cases)

    @property
    def score(self) -> float:
        return mean(self.scores) if self.cases else float("nan")

    @property
    def interval(self) -> tuple[float, float]:
        return stats.interval(self.scores) if self.cases else (float("nan"), float("nan"))

    def minus(self, other: Row) -> tuple[float, tuple[float, float], int]:
        """This setting's score minus ``other``'s on the cases both ran, with its interval and n."""
        return stats.paired_difference(self.cases, other.cases)


def rows(out: Path, specs: list[MethodSpec], task: str, length: int) -> list[Row]:
    """The scores of every spec at ``task`` and ``length`` in ``out``'s results (errors left out)."""
    records = [
        r
        for r in runner.read_results(out / runner.RESULTS)
        if r["task"] == task and r["length"] == length and not r.get("error")
    ]
    return [
        Row(
            spec.label,
            dict(spec.params),
            {(r["depth"], r["seed"]): r["score"] for r in records if r["method"] == spec.label},
        )
        for spec in specs
    ]


def best(candidates: list[Row]) -> Row:
    """The highest mean score (ties: more cases, then the earlier setting)."""
    scored = [row for row in candidates if row.n]
    if not scored:
        raise ValueError("no setting has a finished case yet: run (or resume) the grid first")
    return max(scored, key=lambda row: (row.score, row.n, -candidates.index(row)))


def apply_line(method: str, params: dict) -> str:
    """The Python line that applies a setting."""
    arguments = "".join(f", {k}={tuple(v) if isinstance(v, (list, tuple)) else v!r}" for k, v in params.items())
    return f'longreach.apply(model, "{method}"{arguments})'


def markdown(title: str, table: list[Row], winner: Row, method: str, baseline: Row | None = None) -> str:
    """The table of settings with n and intervals (and each one's paired difference from ``baseline``),
    the best, and which settings it cannot be told from."""
    against = f" | minus {baseline.label}, same cases" if baseline else ""
    lines = [
        f"## {title}",
        "",
        f"| setting | score | 95% interval | n{against} |",
        "|---|---|---|---|" + "---|" * bool(baseline),
    ]
    for row in table:
        mark = " **best**" if row is winner else ""
        cells = [f"`{row.label}`{mark}", f"{row.score:.1f}", report_cells.bounds(row.interval), str(row.n)]
        if baseline:
            cells.append("" if row is baseline else report_cells.difference(*row.minus(baseline)))
        lines.append("| " + " | ".join(cells) + " |")
    settings = [row for row in table if row is not baseline and row.n]
    if all(row.score == winner.score for row in settings) and (baseline is None or baseline.score == winner.score):
        against = f", and {baseline.label} too" if baseline else ""
        lines += ["", f"No best: every setting scores {winner.score:.1f} at this n{against}."]
        return "\n".join(lines) + "\n"
    low = winner.interval[0]
    close = [row.label for row in table if row is not winner and row.n and not (row.interval[1] < low)]
    lines += ["", f"Best: `{apply_line(method, winner.params)}` ({winner.score:.1f}, n = {winner.n})."]
    if baseline is not None and baseline.n and winner.score <= baseline.score:
        lines.append(f"It is no better than {baseline.label} ({baseline.score:.1f}) on these cases.")
    if close:
        lines.append(f"Not separable from it at this n (intervals overlap): {', '.join(f'`{c}`' for c in close)}.")
    return "\n".join(lines) + "\n"


def plot(table: list[Row], title: str, path: Path) -> Path:
    """Score per setting with its 95% interval."""
    return plots.intervals(
        [row.label for row in table], [row.score for row in table], [row.interval for row in table], title, path
    )


def run(
    model: str,
    method: str,
    grid: dict[str, list],
    task: str,
    length: int,
    samples: int,
    out: Path,
    fixed: dict | None = None,
    baseline: str | None = "rope",
    training_window: int | None = None,
    batch_size: int = 1,
    limit: int | None = None,
    loaded=None,
) -> tuple[list[Row], Row, str]:
    """Score every combination of a method's parameters on one task at one length (``longreach tune``).

    Resumes ``out``; writes ``tune_METHOD.md``, ``.json`` and ``.png``. Several methods may share one
    folder: their ``rope`` cases are then run once.

    Args:
        model: ``default``, a local folder or a hub id.
        method: a position method.
        grid: each parameter's values, e.g. ``{"shift": [1024, 2048]}``.
        task: the task to score on.
        length: the length in tokens.
        samples: cases per setting.
        out: the results folder.
        fixed: parameters held fixed, e.g. ``{"local_window": 128}``.
        baseline: the method every setting is paired with on the same cases (``None``: none).
        training_window: ``L``; default the model's.
        batch_size: cases decoded together.
        limit: at most this many new cases.
        loaded: a ``(model, tokenizer)`` already loaded.

    Returns:
        ``(rows, best, markdown)``: a row per setting (score, interval, n, paired difference), the best
        one, and the report.
    """
    specs = settings(method, grid, fixed)
    extra = [MethodSpec.parse(baseline)] if baseline else []
    evaluation = Grid(model, [task], specs + extra, [length], [0.5], samples, training_window)
    runner.run(evaluation, out, Transformers(loaded), limit=limit, batch_size=batch_size)
    table = rows(out, specs + extra, task, length)
    winner = best(table[: len(specs)])
    title = f"{method} on {task} at {length} tokens ({samples} cases per setting)"
    text = markdown(title, table, winner, method, table[-1] if baseline else None)
    (out / f"tune_{method}.md").write_text(text, encoding="utf-8")
    (out / f"tune_{method}.json").write_text(
        json.dumps(
            {
                "method": method,
                "task": task,
                "length": length,
                "grid": grid,
                "fixed": fixed or {},
                "rows": [
                    {
                        "label": r.label,
                        "params": r.params,
                        "score": r.score,
                        "interval": list(r.interval),
                        "n": r.n,
                        **(
                            {
                                "minus_baseline": dict(
                                    zip(("difference", "interval", "n"), r.minus(table[-1]), strict=True)
                                )
                            }
                            if baseline and r is not table[-1]
                            else {}
                        ),
                    }
                    for r in table
                ],
                "best": {"label": winner.label, "params": winner.params, "apply": apply_line(method, winner.params)},
            },
            indent=1,
            default=list,
        )
        + "\n",
        encoding="utf-8",
    )
    plot(table, title, out / f"tune_{method}.png")
    return table, winner, text

"""The report's InfiniteBench table: per prompt set and length, each method's score on every task in the STRING
paper's column order (En.Sum ... Retr.KV), then upstream's other three, and the average of the paper's nine."""

from __future__ import annotations

from collections import defaultdict
from statistics import mean

from ...plots import length_text
from .. import infbench, stats
from .cells import bounds, number

COLUMNS = {**infbench.PAPER, **infbench.OTHERS}  # task -> its name in the paper's table


def infbench_section(model: str, family: str, rows: list[dict], summary: dict) -> str:
    """One table per length of ``family``'s records (``infbench`` or ``infbench-qwen2``): rows are methods, cells the
    task's mean score with its 95% interval and n (Wilson for pass/fail, bootstrap for means); ``Avg.`` is the mean
    of the nine task means with a bootstrap interval resampling each task's cases, where all nine ran."""
    by_cell = defaultdict(list)  # (method, length, task) -> scores
    for r in rows:
        by_cell[r["method"], r["length"], r["task"].split(":", 1)[1]].append(r["score"])
    methods = list(dict.fromkeys(r["method"] for r in rows))
    present = {r["task"].split(":", 1)[1] for r in rows}
    columns = [task for task in COLUMNS if task in present]
    prompts = infbench.FAMILIES[family]
    lines = [
        f"## InfiniteBench{' — ' + model if model else ''} ({family}: STRING's {prompts} prompts)\n",
        f"Reproduces {infbench.REVISION}. Columns in the STRING paper's order (its table's nine, then upstream's other "
        "tasks run); a score is the task's mean x 100 with its 95% interval and n; Avg. is the mean of the paper's "
        "nine, where all nine ran.\n",
    ]
    for length in sorted({r["length"] for r in rows}):
        lines += [
            f"**{length_text(length)}**\n",
            "| method | " + " | ".join(COLUMNS[t] for t in columns) + " | Avg. |",
            "|---" * (len(columns) + 2) + "|",
        ]
        for method in methods:
            cells, groups = [], {}
            for task in columns:
                scores = by_cell[method, length, task]
                if not scores:
                    cells.append("—")
                    continue
                cells.append(f"{mean(scores):.1f} {bounds(stats.interval(scores))} n={len(scores)}")
                if task in infbench.PAPER:
                    groups[task] = scores
            average = "—"
            if len(groups) == len(infbench.PAPER):
                score, (low, high) = mean(mean(g) for g in groups.values()), stats.bootstrap(list(groups.values()))
                average = f"{score:.1f} {bounds((low, high))}"
                summary["infbench"].append(
                    {
                        "model": rows[0]["model"],
                        "family": family,
                        "method": method,
                        "length": length,
                        "score": score,
                        "low": number(low),
                        "high": number(high),
                        "cases": sum(len(g) for g in groups.values()),
                    }
                )
            lines.append(f"| {method} | " + " | ".join(cells) + f" | {average} |")
        lines.append("")
    return "\n".join(lines)

"""What a length meant in a run: per model, task and length, the prompt tokens of its cases and the haystack
sizes they had -- for ``ruler:*`` the size RULER's search found, which every case backs off from.

RULER's search runs once per task and length on one random sample, so that size is one draw: another
stream's search lands elsewhere, and every case with it (docs/measuring.md, "How big each haystack is").
"""

from __future__ import annotations

from collections import defaultdict
from statistics import mean


def sizes(records: list[dict]) -> list[dict]:
    """One row per (model, task, length): its cases (each (depth, seed) once: every method reads the same
    prompt), their prompt tokens (mean, min, max), haystack units (min, max) and the searched sizes seen
    (one per run; ``None`` where the task has none or the records predate it)."""
    cases = defaultdict(dict)
    for r in records:
        if "n_tokens" in r:
            cases[r["model"], r["task"], r["length"]].setdefault((r["depth"], r["seed"]), r)
    rows = []
    for (model, task, length), by_case in sorted(cases.items()):
        tokens = [r["n_tokens"] for r in by_case.values()]
        units = [r["haystack_units"] for r in by_case.values() if "haystack_units" in r]
        searched = sorted({r["searched_units"] for r in by_case.values() if "searched_units" in r})
        rows.append(
            {
                "model": model,
                "task": task,
                "length": length,
                "cases": len(tokens),
                "tokens": {"mean": mean(tokens), "min": min(tokens), "max": max(tokens)},
                "haystack_units": {"min": min(units), "max": max(units)} if units else None,
                "searched_units": searched or None,
            }
        )
    return rows


def section(rows: list[dict], fmt_length) -> str:
    """``summary.md``'s table of :func:`sizes`: a row per task, a column per length."""
    if not rows:
        return ""
    lengths = sorted({r["length"] for r in rows})
    models = sorted({r["model"] for r in rows})
    cells = {(r["model"], r["task"], r["length"]): r for r in rows}
    lines = [
        "## Prompt sizes\n",
        "Prompt tokens per case (mean [min, max], generation not counted) and, for `ruler:*`, the "
        "haystack size RULER's search found for the task and length, in the task's units (essay words, lines, "
        "documents, words), which every case starts from and backs off. That search is one random draw: another "
        "stream's lands elsewhere, and every case with it (docs/measuring.md).\n",
        "| task | " + " | ".join(fmt_length(n) for n in lengths) + " |",
        "|---" * (len(lengths) + 1) + "|",
    ]
    for model in models:
        for task in sorted({r["task"] for r in rows if r["model"] == model}):
            texts = []
            for n in lengths:
                r = cells.get((model, task, n))
                if r is None:
                    texts.append("—")
                    continue
                t = r["tokens"]
                searched = f"; searched {', '.join(map(str, r['searched_units']))}" if r["searched_units"] else ""
                texts.append(f"{t['mean']:,.0f} [{t['min']:,}, {t['max']:,}]{searched}")
            lines.append(f"| {task}{' — ' + model if len(models) > 1 else ''} | " + " | ".join(texts) + " |")
    return "\n".join(lines) + "\n"

"""The report's sections on how the cases ran rather than what they scored: seconds per case (:func:`time_section`),
the cases that failed (:func:`errors_section`) and the runs that made the folder (:func:`runs_section`)."""

from __future__ import annotations

from collections import defaultdict
from statistics import median

from ... import provenance
from ...plots import length_text


def seconds_by_batch(rows: list[dict]) -> dict[str, float]:
    """Median seconds per case for each number of cases decoded together ("0": not recorded), as the time table."""
    seconds = defaultdict(list)
    for r in rows:
        seconds[r.get("batch") or 0].append(r.get("seconds", 0.0))
    return {str(batch): median(values) for batch, values in sorted(seconds.items())}


def time_section(records: list[dict]) -> str:
    """Seconds per case (decoding and building), per machine, task, method, batch size and length, so a
    reader can plan a larger run: a batch's time is shared among its cases, and cases decoded in batches of
    different sizes get a row each (a median over both would describe neither), with the row's case count."""
    lengths = sorted({r["length"] for r in records})
    several = len({r["model"] for r in records}) > 1
    seconds = defaultdict(list)
    for r in records:
        row = (
            *((r["model"],) if several else ()),
            f"{r.get('machine', 'not recorded')}, {r.get('dtype', 'float32')}",
            r["task"],
            r["method"],
            r.get("batch") or 0,
        )
        seconds[row, r["length"]].append(r.get("seconds", 0.0))
    header = f"| {'model | ' if several else ''}machine | task | method | batch | cases | "
    lines = [
        "## Time per case\n",
        "Seconds per case (the median over the cases, so one slow batch among several moves "
        "it little), on the machine and precision that ran it, per number of cases decoded together (a cell's "
        "last batch can be smaller).\n",
        header + " | ".join(length_text(n) for n in lengths) + " |",
        "|---" * (len(lengths) + 5 + several) + "|",
    ]
    for row in sorted({row for row, _ in seconds}):
        *names, batch = row
        cases = sum(len(seconds[row, n]) for n in lengths)
        lines.append(
            f"| {' | '.join(names)} | {batch or '?'} | {cases} | "
            + " | ".join(f"{median(seconds[row, n]):.1f}" if seconds[row, n] else "—" for n in lengths)
            + " |"
        )
    return "\n".join(lines) + "\n"


def errors_section(failed: list[dict]) -> str:
    """Cases that raised: counted per task, length and method, with the first message; a rerun retries them."""
    groups = defaultdict(list)
    for r in failed:
        groups[r["task"], r["length"], r["method"]].append(r["error"])
    lines = [
        f"## Failed cases\n\n{len(failed)} cases raised an error and are not in the tables above "
        "(rerun the same command to retry them).\n",
        "| task | length | method | cases | first error |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {task} | {length_text(length)} | {method} | {len(errors)} | {errors[0][:200]} |"
        for (task, length, method), errors in sorted(groups.items())
    ]
    return "\n".join(lines) + "\n"


def runs_section(runs: list[dict]) -> str:
    """Who made these results: each run of the grid (``runs.jsonl``) with longreach's version and commit, the model
    it resolved to, the new cases it set out to run and its command line."""
    lines = ["## Runs\n"]
    if not runs:
        return "\n".join(lines + ["Not recorded: this folder's cases ran before longreach kept runs.jsonl.\n"])
    lines += [
        "Each run that had cases to run (runs.jsonl), with the longreach that ran it and the model its --model "
        "resolved to.\n",
        "| started | longreach | model | new cases | command |",
        "|---|---|---|---|---|",
    ]
    for run in runs:
        version = provenance.label(str(run.get("longreach", "?")), run.get("git"))
        command = str(run.get("command", "?")).replace("|", "\\|")
        model = run.get("model_name") or run.get("model", "?")
        lines.append(f"| {run.get('started', '?')} | {version} | {model} | {run.get('cases', '?')} | `{command}` |")
    return "\n".join(lines) + "\n"

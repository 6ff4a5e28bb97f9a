"""The two steps of ``docs/study/run.sh`` that are not evaluations: which methods go on to RULER, and
publishing the results folders' reports into ``docs/study/``.

``python -m longreach.study best FOLDER --exclude rope string --count 2`` prints the labels of the
methods with the highest mean score over the folder's (task, length) cells, one per line;
``python -m longreach.study publish FOLDER... --to docs/study`` rebuilds each folder's report
(:func:`.eval.report.build`), copies its results (every case), runs.jsonl, summary.md, summary.json, summary.csv
and the plots it links to ``docs/study/<part>/`` and writes ``docs/study/index.md``: per part the cells with their n,
and the paired differences against rope (RULER's: of its average over tasks).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from collections import defaultdict
from pathlib import Path
from statistics import mean

from . import provenance
from .eval import report
from .eval.records import RESULTS, read_results
from .eval.report import cells as report_cells
from .eval.report import summary_csv
from .plots import length_text


def best(folder: Path, exclude: list[str], count: int) -> list[str]:
    """The ``count`` method labels of ``folder`` with the highest mean of their cell means (ties: the
    earlier label in the results). Only methods with every (task, length) cell of the folder compete."""
    records = [r for r in read_results(folder / RESULTS) if not r.get("error")]
    cells = defaultdict(list)
    for r in records:
        cells[r["method"], r["task"], r["length"]].append(r["score"])
    grid = {(task, length) for _, task, length in cells}
    methods = [m for m in dict.fromkeys(r["method"] for r in records) if m not in exclude]
    complete = [m for m in methods if all((m, *cell) in cells for cell in grid)]
    if len(complete) < count:
        raise ValueError(
            f"{folder} has {len(complete)} methods with every cell ({', '.join(complete) or 'none'}) "
            f"besides {', '.join(exclude)}: run step 1 of docs/study/run.sh to the end first"
        )
    score = {m: mean(mean(cells[(m, *cell)]) for cell in grid) for m in complete}
    return sorted(complete, key=lambda m: -score[m])[:count]


def publish(folders: list[Path], to: Path) -> Path:
    """Rebuild the reports of ``folders`` that hold results, copy them with the results to
    ``to/<part>/`` (``longreach report`` rebuilds the report there); write ``to/index.md``."""
    parts = []
    for folder in folders:
        if not read_results(folder / RESULTS):
            continue
        report.build(folder)
        part = to / folder.name.removeprefix("study_")
        if part.exists():
            shutil.rmtree(part)
        part.mkdir(parents=True)
        kept = [
            name for name in (provenance.RUNS,) if (folder / name).exists()
        ]  # absent in a folder run before it was kept
        for name in [RESULTS, *kept, "summary.md", "summary.json", summary_csv.NAME, *_pictures(folder / "summary.md")]:
            shutil.copy2(folder / name, part / name)
        parts.append((folder, part, json.loads((folder / "summary.json").read_text(encoding="utf-8"))))
    if not parts:
        raise ValueError(f"none of {', '.join(map(str, folders))} holds results yet: run docs/study/run.sh")
    index = to / "index.md"
    index.write_text(_index(parts, to), encoding="utf-8")
    return index


def _pictures(summary: Path) -> list[str]:
    """The pictures ``summary`` links (a results folder may also hold pictures of earlier reports)."""
    return sorted(set(re.findall(r"\]\(([^()/]+\.png)\)", summary.read_text(encoding="utf-8"))))


def _index(parts: list[tuple[Path, Path, dict]], to: Path) -> str:
    lines = [
        "# The study: results as they stand\n",
        "Written by `docs/study/run.sh` (`make study`) from the results folders named below; each part's "
        "summary.md has every table, interval and plot, and its results.jsonl every case. Cells: cases per "
        "(task, method, length).\n",
    ]
    for folder, part, summary in parts:
        lines += [f"## {part.name} ({folder})\n", f"[summary.md]({part.relative_to(to)}/summary.md)\n"]
        counts = defaultdict(dict)
        for cell in summary["cells"]:
            counts[cell["task"], cell["method"]][cell["length"]] = cell["n"]
        for entry in summary["ruler"]:
            counts[entry.get("family", "ruler"), entry["method"]][entry["length"]] = entry["cases"]
        lengths = sorted({n for row in counts.values() for n in row})
        lines += [
            "| task | method | " + " | ".join(length_text(n) for n in lengths) + " |",
            "|---" * (len(lengths) + 2) + "|",
        ]
        lines += [
            f"| {task} | {method} | " + " | ".join(str(row.get(n, "—")) for n in lengths) + " |"
            for (task, method), row in sorted(counts.items())
            if ":" not in task
        ]  # a RULER task: in its family's row
        paired = defaultdict(dict)
        for p in summary["paired"] + [{**p, "task": p.get("family", "ruler")} for p in summary["ruler_paired"]]:
            if p["n"] and ":" not in p["task"]:
                paired[p["task"], p["method"]][p["length"]] = report_cells.difference(
                    p["difference"], (_nan(p["low"]), _nan(p["high"])), p["n"]
                )
        if paired:
            lines += [
                "",
                f"Minus {report_cells.BASELINE} on the same cases (mean paired difference, 95% bootstrap interval, "
                "pairs):",
                "",
                "| task | method | " + " | ".join(length_text(n) for n in lengths) + " |",
                "|---" * (len(lengths) + 2) + "|",
            ]
            lines += [
                f"| {task} | {method} | " + " | ".join(row.get(n, "—") for n in lengths) + " |"
                for (task, method), row in sorted(paired.items())
            ]
        lines.append("")
    return "\n".join(lines)


def _nan(value: float | None) -> float:
    return float("nan") if value is None else value


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m longreach.study", description=__doc__.split("\n\n")[0])
    steps = parser.add_subparsers(dest="step", required=True)
    choose = steps.add_parser("best", help="print the best methods of a results folder, one per line")
    choose.add_argument("folder", type=Path)
    choose.add_argument("--exclude", nargs="*", default=[], help="method labels that do not compete")
    choose.add_argument("--count", type=int, default=2)
    share = steps.add_parser("publish", help="copy the folders' reports to a docs folder, with an index")
    share.add_argument("folders", type=Path, nargs="+")
    share.add_argument("--to", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        if args.step == "best":
            print("\n".join(best(args.folder, args.exclude, args.count)))
        else:
            print(f"wrote {publish(args.folders, args.to)}")
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None


if __name__ == "__main__":
    main()

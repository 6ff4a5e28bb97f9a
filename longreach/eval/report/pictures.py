"""The report's pictures: scores by length with the paired differences under them, heatmaps by depth, loss by
position; each axis says its unit and each colour bar what its cells are."""

from __future__ import annotations

import hashlib
import itertools
import re
from pathlib import Path
from statistics import mean

import numpy as np

from ... import plots

PICTURES = ("compare_*.png", "heatmap_*.png", "loss_by_position_*.png")  # what a report draws in its folder
SCORES = {  # a metric -> what a score of it is, in percent
    "at_least_2_of_4": "pass rate (% of cases with 2 of 4 needles back)",
    "first_integer": "pass rate (% of cases whose first number is the key)",
    "string_match_all": "score (% of the references found, mean over cases)",
    "string_match_part": "score (% of cases with a reference found)",
    "probe_retrieval": "accuracy (% of cases)",
    "ruler": "RULER score (%, the mean of the task means)",
}
QUARTERS = ["0-25%", "25-50%", "50-75%", "75-100%"]


def score_label(metric: str) -> str:
    return SCORES.get(metric, "score (%)")


def slug(text: str, limit: int = 60) -> str:
    """``text`` as part of a file name; past ``limit`` characters cut, with 8 hex digits of its hash to stay
    unique (a method's label with paths and per-layer lists runs past 100 characters)."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_")
    if len(name) <= limit:
        return name
    return name[: limit - 9].rstrip("_.-") + "_" + hashlib.sha1(text.encode()).hexdigest()[:8]


def compare(
    out: Path,
    name: str,
    title: str,
    scores: dict,
    bands: dict,
    differences: dict,
    metric: str,
    threshold: float,
    window: int | None,
    baseline: str,
) -> Path:
    """``compare_NAME.png``: score by length per method with its interval; under it, each method minus ``baseline``
    on the same cases (``differences[method] = (lengths, values, intervals)``), where there are pairs."""
    return plots.compare(
        scores,
        bands,
        f"{title}: score vs length",
        out / f"compare_{slug(name)}.png",
        score_label(metric),
        {m: d for m, d in differences.items() if d[0]},
        baseline,
        threshold,
        {"training window": window} if window else None,
    )


def perplexity(out: Path, task: str, scores: dict, window: int | None) -> Path:
    return plots.lines(
        scores,
        f"{task}: perplexity vs length",
        out / f"compare_{slug(task)}.png",
        ylabel="perplexity (per token, log scale)",
        marks={"training window": window} if window else None,
        log_y=True,
    )


def remove_stale(out: Path, markdown: str) -> None:
    """Remove the pictures of the report's own kinds that this report no longer draws (a method or a
    task gone from the results, a heatmap renamed): only what ``summary.md`` links stays."""
    linked = set(re.findall(r"\]\(([^)]+\.png)\)", markdown))
    for pattern in PICTURES:
        for picture in out.glob(pattern):
            if picture.name not in linked:
                picture.unlink()


def loss_by_position(out: Path, task: str, rows: list[dict], methods: list[str], window: int | None) -> Path:
    """Mean loss per position bucket at the longest tested length, one line per method."""
    longest = max(r["length"] for r in rows)
    series = {}
    for method in methods:
        mine = [r for r in rows if r["method"] == method and r["length"] == longest]
        if mine:
            edges = mine[0]["bucket_edges"]
            centres = [(a + b) / 2 for a, b in itertools.pairwise(edges)]
            series[method] = (centres, [mean(values) for values in zip(*(r["bucket_loss"] for r in mine), strict=True)])
    return plots.lines(
        series,
        f"{task}: loss by position at {plots.length_text(longest)} tokens",
        out / f"loss_by_position_{slug(task)}.png",
        ylabel="mean next-token loss (nats per token)",
        xlabel="position (tokens; K = 1024)",
        tokens="positions",
        marks={"training window": window} if window and window < longest else None,
    )


def heatmap(out: Path, task: str, method: str, rows: list[dict], lengths: list[int]) -> Path | None:
    """Score by needle depth x length: by grid depth (the cell: the cases' score), or each needle at the depth it
    was placed (quarters; the cell: the share of the needles placed there that came back)."""
    if all(r["depth"] is not None for r in rows):
        depths = sorted({r["depth"] for r in rows})
        labels, value = [f"{d:.0%}" for d in depths], score_label(rows[0]["metric"])

        def place(r):
            return [(depths.index(r["depth"]), r["score"])]
    elif all(r.get("found") and len(r["found"]) == len(r.get("needle_depths") or []) for r in rows):
        one = all(len(r["found"]) == 1 for r in rows)
        labels, value = (
            QUARTERS,
            "pass rate (% of the cases with their needle at that depth)"
            if one
            else "needles found (% of the needles placed at that depth)",
        )

        def place(r):
            return [(min(3, int(d * 4)), 100.0 * f) for d, f in zip(r["needle_depths"], r["found"], strict=True)]
    else:
        return None
    sums, counts = np.zeros((len(labels), len(lengths))), np.zeros((len(labels), len(lengths)))
    for r in rows:
        for row, score in place(r):
            sums[row, lengths.index(r["length"])] += score
            counts[row, lengths.index(r["length"])] += 1
    with np.errstate(invalid="ignore"):
        grid = sums / counts
    return plots.heatmap(
        grid,
        labels,
        [plots.length_text(n) for n in lengths],
        f"{task} — {method}",
        out / f"heatmap_{slug(task)}_{slug(method)}.png",
        value=value,
    )

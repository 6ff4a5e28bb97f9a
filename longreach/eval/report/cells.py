"""The report's cells -- the cases of one (model, task, method, length) -- and how a score, an interval, a paired
difference and an effective length are written (every score with its n and its 95% interval: :mod:`..stats`)."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from statistics import mean

from ...plots import length_text
from .. import stats

BASELINE = "rope"  # every other method's paired difference is taken against it
effective_length = stats.effective_length


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


def number(value: float) -> float | None:
    """JSON has no NaN: a missing interval bound is null."""
    return None if isinstance(value, float) and math.isnan(value) else value


def paired_record(
    where: dict, method: str, baseline: str, length: int, value: float, interval: tuple[float, float], pairs: int
) -> dict:
    """One record of the summary's paired differences: ``where`` (the model and the task, or the model and the RULER
    family), then ``method`` minus ``baseline`` at ``length``, its interval (a missing bound null) and its pairs."""
    low, high = interval
    return {
        **where,
        "method": method,
        "minus": baseline,
        "length": length,
        "difference": number(value),
        "low": number(low),
        "high": number(high),
        "n": pairs,
    }


def group_cells(rows: list[dict]) -> dict[tuple[str, int], Cell]:
    cells = defaultdict(list)
    for r in rows:
        cells[r["method"], r["length"]].append(r)
    return {key: Cell(value) for key, value in cells.items()}


def effective_lengths(by_length: dict[int, tuple[float, float]], threshold: float) -> dict:
    """Effective length by both published rules, each by the point estimates and by the intervals' lower bounds (the
    sure one), from each length's ``(score, lower bound)``: RULER's absolute ``threshold`` (``point``, ``sure``) and
    NoLiMa's 85% of the score at the shortest length (``relative``, ``relative_sure``; the base is that length's
    point estimate in both). ``None`` each with no length to read it on."""
    if not by_length:
        return {"point": None, "sure": None, "relative": None, "relative_sure": None}
    points = {n: score for n, (score, _) in by_length.items()}
    lows = {n: low for n, (_, low) in by_length.items()}
    base = points[min(points)]
    return {
        "point": effective_length(points, threshold),
        "sure": effective_length(lows, threshold),
        "relative": stats.relative_effective_length(points, base),
        "relative_sure": stats.relative_effective_length(lows, base),
    }


def effective_text(effective: dict) -> str:
    """``8K (sure: 4K); relative 16K (sure: 8K)``: RULER's rule, then NoLiMa's (85% of the shortest length's score)."""
    if effective["point"] is None:  # no complete length to read it on
        return "—"

    def name(n):
        return length_text(n) if n else "none"

    text = f"{name(effective['point'])} (sure: {name(effective['sure'])})"
    if effective.get("relative") is None:  # a score of 0 at the shortest length: nothing to keep
        return text + "; relative —"
    return text + f"; relative {name(effective['relative'])} (sure: {name(effective['relative_sure'])})"


def differences(paired: dict[str, dict[int, tuple]]) -> dict[str, tuple[list, list, list]]:
    """``paired[method][length] = (difference, interval)`` as the picture's ``(lengths, differences, intervals)`` per
    method."""
    return {
        method: (list(by_length), [v for v, _ in by_length.values()], [i for _, i in by_length.values()])
        for method, by_length in paired.items()
        if by_length
    }


def baseline_of(rows: list[dict]) -> dict[str, str]:
    """Each row's baseline: the ``rope`` row run with the same ``L`` (a folder may hold rope at two windows,
    each labelled with its resolution); rows whose ``L`` has no rope row are left out."""

    def is_rope(r):
        return r["resolved"] == BASELINE or r["resolved"].startswith(f"{BASELINE} [")

    rope = {r.get("window"): r["method"] for r in rows if is_rope(r)}
    pairs = {r["method"]: rope.get(r.get("window")) for r in rows if not is_rope(r)}
    return {method: baseline for method, baseline in pairs.items() if baseline is not None}

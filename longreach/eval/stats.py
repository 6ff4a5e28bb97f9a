"""Intervals and averages a reader can trust: Wilson for pass/fail, bootstrap for means, RULER's averages."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from statistics import NormalDist, mean

CONFIDENCE = 0.95
RULER_THRESHOLD = 85.6  # RULER's effective-length threshold: Llama2-7B's average at 4K
RELATIVE_KEEP = 0.85  # NoLiMa's effective length: the share of the model's own score at its shortest length to keep
RESAMPLES = 2000


def wilson(passed: int, n: int, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Wilson score interval for ``passed`` of ``n`` (Wilson 1927), in percent."""
    if n == 0:
        return (math.nan, math.nan)
    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    p = passed / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    low = 0.0 if passed == 0 else max(0.0, centre - half)  # exact at the ends, where rounding leaves 1e-15
    high = 1.0 if passed == n else min(1.0, centre + half)
    return (100 * low, 100 * high)


def bootstrap(
    groups: Sequence[Sequence[float]],
    statistic=None,
    confidence: float = CONFIDENCE,
    resamples: int = RESAMPLES,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile bootstrap interval of ``statistic`` (default: the mean of the group means), resampling
    each group's values with replacement on its own (stratified: a group is a task of RULER's average).
    NaN when a group has fewer than 2 values."""
    if any(len(g) < 2 for g in groups):  # one value says nothing of its spread
        return (math.nan, math.nan)
    statistic = statistic or (lambda samples: mean(mean(g) for g in samples))
    rng = random.Random(seed)
    draws = sorted(statistic([rng.choices(g, k=len(g)) for g in groups]) for _ in range(resamples))
    tail = (1 - confidence) / 2
    return (draws[int(tail * (resamples - 1))], draws[math.ceil((1 - tail) * (resamples - 1))])


def interval(scores: Sequence[float]) -> tuple[float, float]:
    """A cell's 95% interval: Wilson when every score is 0 or 100 (pass/fail), else a bootstrap of the mean."""
    if all(s in (0.0, 100.0) for s in scores):
        return wilson(sum(s == 100.0 for s in scores), len(scores))
    return bootstrap([scores])


def paired_difference(a: dict, b: dict) -> tuple[float, tuple[float, float], int]:
    """``a - b`` on the cases both ran (same key: the same prompt under two methods): the mean difference,
    its 95% bootstrap interval over cases, and the number of pairs. Pairing removes the cases' own
    difficulty from the comparison, so it separates methods at an n where their own intervals overlap."""
    return paired_average({"all": a}, {"all": b})


def paired_average(a: dict[str, dict], b: dict[str, dict]) -> tuple[float, tuple[float, float], int]:
    """RULER's average of ``a - b`` (groups: tasks, each a dict of case key to score): per task the mean
    difference over the cases both ran, then the mean over tasks; the bootstrap resamples each task's pairs
    on its own, as RULER's score resamples each task's cases. NaN unless both ran the same tasks and every
    task has a pair. One group is :func:`paired_difference`."""
    if not a or set(a) != set(b):
        return (math.nan, (math.nan, math.nan), 0)
    groups = [[a[task][key] - b[task][key] for key in a[task] if key in b[task]] for task in a]
    if not all(groups):
        return (math.nan, (math.nan, math.nan), 0)
    return (mean(mean(g) for g in groups), bootstrap(groups), sum(len(g) for g in groups))


def weighted_averages(by_length: dict[int, float]) -> dict[str, float]:
    """RULER's Avg. and its weighted averages over lengths: weights 1..k rising with length (inc) or falling (dec)."""
    lengths = sorted(by_length)
    rising = range(1, len(lengths) + 1)

    def weighted(weights):
        return sum(w * by_length[n] for w, n in zip(weights, lengths, strict=True)) / sum(weights)

    return {"avg": mean(by_length.values()), "wavg_inc": weighted(rising), "wavg_dec": weighted(list(rising)[::-1])}


def effective_length(scores: dict[int, float], threshold: float = RULER_THRESHOLD) -> int:
    """The largest tested length L' whose score, and that of every shorter tested length, reaches ``threshold``; 0 if
    none."""
    best = 0
    for length in sorted(scores):
        if not scores[length] >= threshold:  # NaN (no interval) does not reach it either
            break
        best = length
    return best


def relative_effective_length(scores: dict[int, float], base: float, keep: float = RELATIVE_KEEP) -> int | None:
    """NoLiMa's effective length (Modarressi et al., ICML 2025: its tables' threshold is 0.85 x the model's base score):
    the largest tested length whose score, and that of every shorter tested length, keeps ``keep`` of ``base`` (here
    the model's own score at the shortest length tested; NoLiMa's base comes from its own short lengths, 1K and under);
    ``None`` where ``base`` is not above 0 (nothing to keep)."""
    if not base > 0:  # NaN or 0
        return None
    return effective_length(scores, keep * base)

"""Position frequency (STRING paper, section 2, Eq. 1): how often each relative position is trained.

For training window ``L`` and a corpus packed into sequences ``s``, relative position ``i`` occurs
``f(i) = sum_s max(|s| - i, 0)`` times, ``0 <= i < L``. The paper's three packings:

* ``natural``: one document per sequence, truncated at ``L``;
* ``uniform``: the same number of tokens in sequences whose lengths are spread evenly over ``1..L``
  (f falls quadratically);
* ``concatenated``: all documents joined and cut into windows of ``L`` (f falls linearly).

Everything is vectorised over a length histogram: a million documents take well under a second.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

PACKINGS = ("natural", "uniform", "concatenated")
MAX_DOCUMENTS = 10_000_000  # synthetic documents: 80 MB of lengths


def frequency(lengths, window: int, packing: str = "natural") -> np.ndarray:
    """Position frequency ``f(i) = sum_s max(|s| - i, 0)`` (STRING paper, Eq. 1).

    Args:
        lengths: the documents' lengths in tokens.
        window: the training window ``L``.
        packing: ``natural`` (one document per sequence, truncated at ``L``), ``uniform`` or
            ``concatenated`` (documents joined and cut into windows of ``L``).

    Returns:
        ``f(i)`` for ``i = 0 .. window-1``, float64 (exact integers up to 2^53).

    Raises:
        ValueError: an unknown packing, a window < 1, no lengths or a negative one.
    """
    if packing not in PACKINGS:
        raise ValueError(f"packing={packing!r} is not one of: {', '.join(PACKINGS)}")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window={window!r} is out of range: an integer >= 1")
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.ndim != 1 or lengths.size == 0 or (lengths < 0).any():
        raise ValueError("lengths must be a non-empty list of document lengths >= 0")
    i = np.arange(window, dtype=np.float64)
    total = float(lengths.sum())
    if packing == "concatenated":
        full, rest = divmod(int(total), window)
        return full * (window - i) + np.maximum(rest - i, 0)
    if packing == "uniform":
        sequences = total / ((window + 1) / 2)  # mean length of 1..L
        return sequences / window * (window - i) * (window - i + 1) / 2
    counts = np.bincount(np.minimum(lengths, window), minlength=window + 1).astype(np.float64)
    # f(i) = sum_{l > i} c_l (l - i) = A(i) - i B(i), with tail sums A(i) = sum_{l>i} c_l l, B(i) = sum_{l>i} c_l
    levels = np.arange(window + 1, dtype=np.float64)
    tail_count = np.cumsum(counts[::-1])[::-1]
    tail_tokens = np.cumsum((counts * levels)[::-1])[::-1]
    return tail_tokens[1:] - i * tail_count[1:]


def shares(f: np.ndarray) -> dict[str, float]:
    """The share of occurrences at ``i < L/2`` and at ``i >= 3L/4`` (the paper: >80% and <5% at L = 2048).

    Args:
        f: [`frequency`][longreach.analysis.frequency.frequency]'s result.

    Returns:
        ``{"i < L/2": share, "i >= 3L/4": share}``.
    """
    L, total = len(f), f.sum()
    return {"i < L/2": float(f[: L // 2].sum() / total), "i >= 3L/4": float(f[(3 * L + 3) // 4 :].sum() / total)}


def synthetic(spec: str, seed: int = 0) -> np.ndarray:
    """Document lengths from a named distribution: ``lognormal[:mean=6.5,sigma=1.4,count=100000]``,
    ``exponential[:scale=1500,count=...]`` or ``fixed[:length=2048,count=...]``."""
    name, _, rest = spec.partition(":")
    defaults = {"lognormal": {"mean": 6.5, "sigma": 1.4}, "exponential": {"scale": 1500.0}, "fixed": {"length": 2048.0}}
    if name not in defaults:
        raise ValueError(f"synthetic distribution {name!r} is not one of: {', '.join(defaults)}")
    params = {}
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition("=")
        try:
            params[key] = float(value)
        except ValueError:
            raise ValueError(f"{name} parameter {item!r} must look like name=number") from None
    unknown = set(params) - set(defaults[name]) - {"count"}
    if unknown:
        raise ValueError(
            f"{name} has no parameter {', '.join(sorted(unknown))}; its parameters: {', '.join(defaults[name])}, count"
        )
    count = params.pop("count", 100_000)
    if not (count == int(count) and 1 <= count <= MAX_DOCUMENTS):
        raise ValueError(f"count={count:g} is out of range: a whole number of documents 1 .. {MAX_DOCUMENTS:,}")
    count = int(count)
    p = {**defaults[name], **params}
    for key, value in p.items():  # every parameter but lognormal's mean is a positive scale
        if not math.isfinite(value) or (key != "mean" and value <= 0):
            raise ValueError(f"{key}={value:g} is out of range: a finite number{'' if key == 'mean' else ' > 0'}")
    rng = np.random.default_rng(seed)
    if name == "lognormal":
        values = rng.lognormal(p["mean"], p["sigma"], count)
    elif name == "exponential":
        values = rng.exponential(p["scale"], count)
    else:
        values = np.full(count, p["length"])
    return np.maximum(1, np.round(values)).astype(np.int64)


def token_lengths(folder: Path, tokenizer, pattern: str = "*.txt") -> np.ndarray:
    """The token length of every text file under ``folder`` (one document per file)."""
    files = sorted(Path(folder).rglob(pattern))
    if not files:
        raise ValueError(f"no {pattern} files under {folder}")
    return np.array(
        [
            len(tokenizer(f.read_text(encoding="utf-8", errors="replace"), add_special_tokens=False)["input_ids"])
            for f in files
        ],
        dtype=np.int64,
    )


def plot(lengths, window: int, path: Path, title: str = "position frequency") -> Path:
    """f(i) for the three packings on one figure, each normalised to a share of all occurrences."""
    from .. import plots

    series = {}
    for packing in PACKINGS:
        f = frequency(lengths, window, packing)
        s = shares(f)
        series[f"{packing} ({s['i < L/2']:.0%} at i < L/2, {s['i >= 3L/4']:.1%} at i >= 3L/4)"] = (
            list(range(window)),
            list(f / f.sum()),
        )
    return plots.lines(
        series,
        title,
        path,
        ylabel="share of all occurrences",
        xlabel="relative position i (tokens; K = 1024)",
        tokens="positions",
        marks={"L/2": window / 2, "3L/4": 3 * window / 4},
        markers=False,
    )

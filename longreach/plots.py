"""Pictures, written as PNG with matplotlib (no display needed)."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib import ticker  # noqa: E402


def length_text(n: float) -> str:
    """A length in tokens as the tables write it: ``2K`` for 2048 (K = 1024), the number itself otherwise."""
    n = int(n)
    return f"{n // 1024}K" if n and n % 1024 == 0 else str(n)


def _tokens_axis(ax, values: list[float], lengths: bool = True) -> None:
    """x ticks in the tables' units (2K, 4K; K = 1024): at the tested ``lengths`` when there are few of them, else (or
    for positions, ``lengths=False``) at a power-of-two step, 4 to 6 ticks (``0.5K`` where the step is under 1K)."""
    tested = sorted(set(values))
    if lengths and 0 < len(tested) <= 10:
        ax.set_xticks(tested, [length_text(n) for n in tested])
        return
    step = 64
    while max(tested, default=0) / step > 6:
        step *= 2
    ax.xaxis.set_major_locator(ticker.MultipleLocator(step))
    ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda n, _: _k(n)))


def _k(n: float) -> str:
    """A position on a continuous axis in K: ``0.25K``, ``1.5K`` (a multiple of 128), the number otherwise."""
    return f"{n / 1024:g}K" if n and n % 128 == 0 else f"{n:g}"


def heatmap(
    grid: np.ndarray,
    rows: list[str],
    columns: list[str],
    title: str,
    path: Path,
    xlabel: str = "context length (tokens; K = 1024)",
    ylabel: str = "needle depth (% of the context)",
    value: str = "score (%)",
    vmax: float = 100.0,
) -> Path:
    """A grid of percentages (rows x columns, NaN = not tested), red (0) to green (vmax), each value written in its
    cell in black or white, whichever reads on its colour; the colour bar says what a cell is (``value``). A long
    title (a calibrated DPE's method string) is wrapped by ``legend_label`` to stay inside the figure."""
    fig, ax = plt.subplots(figsize=(1.2 * len(columns) + 3.0, 0.5 * len(rows) + 1.8))
    colours = plt.get_cmap("RdYlGn")
    image = ax.imshow(np.ma.masked_invalid(grid), cmap=colours, vmin=0, vmax=vmax, aspect="auto")
    ax.set_xticks(range(len(columns)), columns)
    ax.set_yticks(range(len(rows)), rows)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(legend_label(title), fontsize=9)
    for (r, c), cell in np.ndenumerate(grid):
        if not np.isnan(cell):
            red, green, blue, _ = colours(min(max(cell / vmax, 0.0), 1.0))
            ink = "black" if 0.299 * red + 0.587 * green + 0.114 * blue > 0.5 else "white"  # perceived brightness
            ax.text(c, r, f"{cell:.0f}", ha="center", va="center", fontsize=10, fontweight="bold", color=ink)
    fig.colorbar(image, ax=ax, label=textwrap.fill(value, 28))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def method_name(label: str) -> str:
    """A method string with each file named in it by its stem alone: ``dimensions=dpe_dimensions_8k``, not the path
    it was read from."""
    return re.sub(r"=([^,=]*/)?([^,=/]+?)\.(safetensors|json|pt|npy|txt)(?=,|$|\))", r"=\2", label)


def legend_label(label: str, width: int = 56) -> str:
    """A method string as a legend shows it (:func:`method_name`), broken after its commas into lines of at most
    ``width`` characters, so a long one (a calibrated DPE's, 120 characters) stays readable."""
    return textwrap.fill(re.sub(r",(?! )", ", ", method_name(label)), width)


def _draw(ax, series: dict[str, tuple[list[float], list[float]]], bands: dict | None, markers: bool) -> None:
    """One line per label, with its shaded interval per point where ``bands[label]`` gives (low, high)s."""
    for label, (x, y) in series.items():
        (line,) = ax.plot(x, y, marker="o" if markers else None, label=legend_label(label))
        if bands and bands.get(label):
            low, high = zip(*bands[label], strict=True)
            ax.fill_between(x, low, high, color=line.get_color(), alpha=0.15, linewidth=0)


def _marks(ax, marks: dict[str, float] | None) -> None:
    """Vertical dotted lines (the training window), named in the legend, where no label can be clipped."""
    for name, at in (marks or {}).items():
        ax.axvline(
            at, color="black", linestyle=":", linewidth=1.2, zorder=1, label=f"{name} ({_k(at)})"
        )  # behind the points


def _legend(ax) -> None:
    """The legend right of the axes, never over the lines."""
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1), borderaxespad=0)


def lines(
    series: dict[str, tuple[list[float], list[float]]],
    title: str,
    path: Path,
    ylabel: str = "score (%)",
    xlabel: str = "context length (tokens; K = 1024)",
    threshold: float | None = None,
    marks: dict[str, float] | None = None,
    log_y: bool = False,
    markers: bool = True,
    bands: dict[str, list[tuple[float, float]]] | None = None,
    tokens: str | None = "lengths",
) -> Path:
    """One line per label; optional shaded intervals per point (``bands[label]``: (low, high)), a threshold
    line and vertical marks (e.g. the training window), each named in the legend. The legend sits right of
    the axes, never over the lines, with long labels wrapped (``legend_label``). ``tokens``: the x values are
    ``"lengths"`` (ticked where tested, as the tables write them: 2K, 4K), ``"positions"`` (ticked in K), or
    ``None`` (matplotlib's ticks). A log y axis is labelled in plain numbers."""
    fig, ax = plt.subplots(figsize=(7, 4.2))
    _draw(ax, series, bands, markers)
    if threshold is not None:
        ax.axhline(threshold, color="grey", linestyle="--", linewidth=1, label=f"threshold {threshold:g}")
    _marks(ax, marks)
    if log_y:
        ax.set_yscale("log")
        for axis in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
            axis(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    if tokens:
        _tokens_axis(ax, [x for xs, _ in series.values() for x in xs], lengths=tokens == "lengths")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    _legend(ax)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def compare(
    series: dict[str, tuple[list[float], list[float]]],
    bands: dict[str, list[tuple[float, float]]],
    title: str,
    path: Path,
    ylabel: str,
    differences: dict[str, tuple[list[float], list[float], list[tuple[float, float]]]],
    baseline: str,
    threshold: float | None = None,
    marks: dict[str, float] | None = None,
) -> Path:
    """The report's comparison: each method's score by length with its 95% interval (top, 0-100%) and, below,
    each method's paired difference from ``baseline`` on the same cases with its interval, against a line at 0
    (an interval clear of 0 is a difference the data show)."""
    rows = 2 if differences else 1
    fig, axes = plt.subplots(
        rows,
        1,
        figsize=(7, 4.2 + 2.6 * (rows - 1)),
        sharex=True,
        squeeze=False,
        gridspec_kw={"height_ratios": [3, 2][:rows]},
    )
    top = axes[0, 0]
    _draw(top, series, bands, markers=True)
    if threshold is not None:
        top.axhline(threshold, color="grey", linestyle="--", linewidth=1, label=f"threshold {threshold:g}")
    _marks(top, marks)
    top.set_ylim(-3, 103)
    top.set_ylabel(ylabel)
    top.set_title(title)
    top.grid(alpha=0.3)
    _legend(top)
    colours = {
        text.get_text(): line.get_color()
        for line, text in zip(top.get_lines(), top.get_legend().get_texts(), strict=True)
    }
    if differences:
        bottom = axes[1, 0]
        bottom.axhline(0, color="black", linewidth=1)
        tested = [x for xs, _, _ in differences.values() for x in xs]
        nudge = 0.012 * ((max(tested) - min(tested)) or max(tested))  # methods side by side, so each interval shows
        for i, (label, (x, y, bounds)) in enumerate(differences.items()):
            shift = (i - (len(differences) - 1) / 2) * nudge
            bottom.errorbar(
                [at + shift for at in x],
                y,
                yerr=_error_bars(y, bounds),
                fmt="o-",
                capsize=3,
                linewidth=1.2,
                markersize=4,
                color=colours.get(legend_label(label)),
                label=legend_label(label),
            )
        _marks(bottom, marks)
        bottom.set_ylabel(textwrap.fill(f"minus {baseline}, same cases (percentage points)", 26))
        bottom.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("context length (tokens; K = 1024)")
    _tokens_axis(axes[-1, 0], [x for xs, _ in series.values() for x in xs])
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def panels(
    series: dict, title: str, path: Path, xlabel: str, marks: dict[str, float] | None = None, columns: int = 6
) -> Path:
    """Small multiples: ``series[panel][label] = (x, y)``; one panel per key, a shared legend right of them
    with long labels wrapped (``legend_label``)."""
    names = list(series)
    columns = min(columns, len(names))
    rows = (len(names) + columns - 1) // columns
    fig, axes = plt.subplots(rows, columns, figsize=(2.6 * columns, 2.0 * rows + 0.8), squeeze=False, sharex=True)
    for ax, name in zip(axes.flat, names, strict=False):  # not strict: the grid's spare panels are turned off below
        for label, (x, y) in series[name].items():
            ax.plot(x, y, label=legend_label(label), linewidth=1.2)
        for _, at in (marks or {}).items():
            ax.axvline(at, color="black", linestyle=":", linewidth=0.8)
        ax.set_title(f"layer {name}", fontsize=8)
        ax.tick_params(labelsize=6)
    for ax in list(axes.flat)[len(names) :]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.suptitle(title, fontsize=10)
    fig.supxlabel(xlabel, fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.legend(
        handles, labels, loc="upper left", bbox_to_anchor=(1, 0.97), fontsize=8
    )  # beside the panels, as in lines
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def intervals(
    labels: list[str],
    scores: list[float],
    bounds: list[tuple[float, float]],
    title: str,
    path: Path,
    xlabel: str = "score",
) -> Path:
    """One row per label: the score with its interval as a horizontal error bar (best at the top when sorted so)."""
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(labels) + 1.6))
    y = np.arange(len(labels))[::-1]
    ax.errorbar(scores, y, xerr=_error_bars(scores, bounds), fmt="o", capsize=3)
    ax.set_yticks(y, labels, fontsize=7)
    ax.set_xlim(-2, 102)
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def sweeps(
    series: dict[str, tuple[list[float], list[float], list[tuple[float, float]]]],
    title: str,
    path: Path,
    xlabel: str,
    marks: dict[str, float] | None = None,
) -> Path:
    """Small multiples of score against a parameter on a log2 axis: ``series[panel] = (x, y, intervals)``;
    ``marks[panel]`` draws a vertical line (the chosen value)."""
    names = list(series)
    columns = min(4, len(names))
    rows = -(-len(names) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(3.2 * columns, 2.6 * rows + 0.6), squeeze=False, sharey=True)
    for ax, name in zip(axes.flat, names, strict=False):  # not strict: the grid's spare panels are turned off below
        x, y, bounds = series[name]
        ax.errorbar(x, y, yerr=_error_bars(y, bounds), fmt="o-", capsize=3, linewidth=1.2)
        if marks and name in marks:
            ax.axvline(marks[name], color="black", linestyle=":", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_ylim(-2, 102)
        ax.set_title(name, fontsize=9)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(names) :]:
        ax.axis("off")
    fig.suptitle(title, fontsize=10)
    fig.supxlabel(xlabel, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _error_bars(values: list[float], bounds: list[tuple[float, float]]) -> list[list[float]]:
    """Matplotlib's ``[below, above]`` distances from each value to its interval's ends (0 where there is none)."""
    return [
        [v - lo if lo == lo else 0 for v, (lo, _) in zip(values, bounds, strict=True)],
        [hi - v if hi == hi else 0 for v, (_, hi) in zip(values, bounds, strict=True)],
    ]

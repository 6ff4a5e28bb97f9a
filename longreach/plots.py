"""Pictures, written as PNG with matplotlib (no display needed)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def heatmap(grid: np.ndarray, rows: list[str], columns: list[str], title: str, path: Path,
            xlabel: str = "context length (tokens)", ylabel: str = "needle depth", vmax: float = 100.0) -> Path:
    """A score grid (rows x columns, NaN = not tested), red (0) to green (vmax), values in the cells; a long
    title (a calibrated DPE's method string) wrapped by ``legend_label`` to stay inside the figure."""
    fig, ax = plt.subplots(figsize=(1.2 * len(columns) + 2.5, 0.5 * len(rows) + 1.8))
    image = ax.imshow(np.ma.masked_invalid(grid), cmap="RdYlGn", vmin=0, vmax=vmax, aspect="auto")
    ax.set_xticks(range(len(columns)), columns)
    ax.set_yticks(range(len(rows)), rows)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(legend_label(title), fontsize=9)
    for (r, c), value in np.ndenumerate(grid):
        if not np.isnan(value):
            ax.text(c, r, f"{value:.0f}", ha="center", va="center", fontsize=8)
    fig.colorbar(image, ax=ax, label="score")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def legend_label(label: str, width: int = 56) -> str:
    """A method string broken after its commas into lines of at most ``width`` characters, so a long
    one (a calibrated DPE's, 120 characters) stays readable in a legend."""
    return textwrap.fill(label.replace(",", ", "), width)


def lines(series: dict[str, tuple[list[float], list[float]]], title: str, path: Path, ylabel: str = "score",
          xlabel: str = "context length (tokens)", threshold: float | None = None, marks: dict[str, float] | None = None,
          log_y: bool = False, markers: bool = True, bands: dict[str, list[tuple[float, float]]] | None = None) -> Path:
    """One line per label; optional shaded intervals per point (``bands[label]``: (low, high)), a threshold
    line and vertical marks (e.g. the training window). The legend sits right of the axes, never over
    the lines, with long labels wrapped (``legend_label``)."""
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for label, (x, y) in series.items():
        line, = ax.plot(x, y, marker="o" if markers else None, label=legend_label(label))
        if bands and bands.get(label):
            low, high = zip(*bands[label])
            ax.fill_between(x, low, high, color=line.get_color(), alpha=0.15, linewidth=0)
    if threshold is not None:
        ax.axhline(threshold, color="grey", linestyle="--", linewidth=1, label=f"threshold {threshold:g}")
    for name, at in (marks or {}).items():
        ax.axvline(at, color="black", linestyle=":", linewidth=1)
        ax.text(at, ax.get_ylim()[1], f" {name}", va="top", fontsize=8)
    if log_y:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1), borderaxespad=0)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def panels(series: dict, title: str, path: Path, xlabel: str, marks: dict[str, float] | None = None,
           columns: int = 6) -> Path:
    """Small multiples: ``series[panel][label] = (x, y)``; one panel per key, a shared legend right of them
    with long labels wrapped (``legend_label``)."""
    names = list(series)
    columns = min(columns, len(names))
    rows = (len(names) + columns - 1) // columns
    fig, axes = plt.subplots(rows, columns, figsize=(2.6 * columns, 2.0 * rows + 0.8), squeeze=False, sharex=True)
    for ax, name in zip(axes.flat, names):
        for label, (x, y) in series[name].items():
            ax.plot(x, y, label=legend_label(label), linewidth=1.2)
        for _, at in (marks or {}).items():
            ax.axvline(at, color="black", linestyle=":", linewidth=0.8)
        ax.set_title(f"layer {name}", fontsize=8)
        ax.tick_params(labelsize=6)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.suptitle(title, fontsize=10)
    fig.supxlabel(xlabel, fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.legend(handles, labels, loc="upper left", bbox_to_anchor=(1, 0.97), fontsize=8)  # beside the panels, as in lines
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def intervals(labels: list[str], scores: list[float], bounds: list[tuple[float, float]], title: str, path: Path,
              xlabel: str = "score") -> Path:
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


def sweeps(series: dict[str, tuple[list[float], list[float], list[tuple[float, float]]]], title: str, path: Path,
           xlabel: str, marks: dict[str, float] | None = None) -> Path:
    """Small multiples of score against a parameter on a log2 axis: ``series[panel] = (x, y, intervals)``;
    ``marks[panel]`` draws a vertical line (the chosen value)."""
    names = list(series)
    columns = min(4, len(names))
    rows = -(-len(names) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(3.2 * columns, 2.6 * rows + 0.6), squeeze=False, sharey=True)
    for ax, name in zip(axes.flat, names):
        x, y, bounds = series[name]
        ax.errorbar(x, y, yerr=_error_bars(y, bounds), fmt="o-", capsize=3, linewidth=1.2)
        if marks and name in marks:
            ax.axvline(marks[name], color="black", linestyle=":", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_ylim(-2, 102)
        ax.set_title(name, fontsize=9)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    fig.suptitle(title, fontsize=10)
    fig.supxlabel(xlabel, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _error_bars(values: list[float], bounds: list[tuple[float, float]]) -> list[list[float]]:
    """Matplotlib's ``[below, above]`` distances from each value to its interval's ends (0 where there is none)."""
    return [[v - lo if lo == lo else 0 for v, (lo, _) in zip(values, bounds)],
            [hi - v if hi == hi else 0 for v, (_, hi) in zip(values, bounds)]]

"""Pictures of a method's relative-position matrix, drawn from the same method objects the kernel uses."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .. import methods


def matrix(name: str, length: int, training_window: int | None = None, **params) -> tuple[np.ndarray, str]:
    """``(P, description)``: ``P[i, j]`` for ``i, j < length`` (NaN where not attended); ``L`` defaults to ``length``."""
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise ValueError(f"length={length!r} is out of range: an integer >= 1")
    if name not in methods.METHODS:
        kind = "a frequency method: it changes RoPE's frequencies, not positions" if name in methods.scaling.ALIASES else "unknown"
        raise ValueError(f"{name!r} is {kind}; position methods: {', '.join(methods.METHODS)}")
    method = methods.create(name, training_window=training_window or length, **params)
    positions = torch.arange(length)
    return method.relative_positions(positions[:, None], positions[None, :]).numpy(), method.describe()


def plot(P: np.ndarray, title: str, path: Path, numbers: bool | None = None) -> Path:
    """Numbers in the cells for small matrices (as the STRING paper's Figure 5), a colour image otherwise."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = P.shape[0]
    numbers = n <= 24 if numbers is None else numbers
    size = min(10, max(4, 0.45 * n)) if numbers else 7
    fig, ax = plt.subplots(figsize=(size + 1.2, size))
    image = ax.imshow(np.ma.masked_invalid(P), cmap="viridis", interpolation="nearest")
    if numbers:
        for (i, j), value in np.ndenumerate(P):
            if not np.isnan(value):
                ax.text(j, i, f"{value:g}", ha="center", va="center", fontsize=8, color="white" if value < np.nanmax(P) / 2 else "black")
        ax.set_xticks(range(n))
        ax.set_yticks(range(n))
    fig.colorbar(image, ax=ax, label="relative position RoPE sees")
    ax.set_xlabel("key position j")
    ax.set_ylabel("query position i")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path

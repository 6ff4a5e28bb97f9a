"""Pictures of a method's relative-position matrix, drawn from the same method objects the kernel uses."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .. import methods


def matrix(name: str, length: int, training_window: int | None = None, **params) -> tuple[np.ndarray, str]:
    """``(P, description)``: ``P[i, j]`` for ``i, j < length`` (NaN where not attended); ``L`` defaults to ``length``.
    A method with a position per frequency group (DPE, every pair changed) gives ``P[i, j, g]``."""
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise ValueError(f"length={length!r} is out of range: an integer >= 1")
    if name not in methods.METHODS:
        kind = (
            "a frequency method: it changes RoPE's frequencies, not positions"
            if name in methods.scaling.ALIASES
            else "unknown"
        )
        raise ValueError(f"{name!r} is {kind}; position methods: {', '.join(methods.METHODS)}")
    method = methods.create(name, training_window=training_window or length, **params)
    positions = torch.arange(length)
    return method.relative_positions(positions[:, None], positions[None, :]).numpy(), method.describe()


def plot(
    P: np.ndarray, title: str, path: Path, numbers: bool | None = None, panel_titles: list[str] | None = None
) -> Path:
    """Numbers in the cells for small matrices (as the STRING paper's Figure 5), a colour image otherwise;
    ``P [n, n, G]`` draws one panel per frequency group (DPE), titled by ``panel_titles``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = P.shape[0]
    stack = P[..., None] if P.ndim == 2 else P
    panels = stack.shape[-1]
    numbers = n <= 24 if numbers is None else numbers
    size = min(10, max(4, 0.45 * n)) if numbers else 7
    size = size if panels == 1 else min(size, 4.5)
    columns = min(panels, 4)
    rows = -(-panels // columns)
    fig, axes = plt.subplots(
        rows, columns, figsize=((size + 1.2) * columns, size * rows + (0.5 if panels > 1 else 0)), squeeze=False
    )
    for index, ax in enumerate(axes.flat):
        if index >= panels:
            ax.axis("off")
            continue
        panel = stack[..., index]
        image = ax.imshow(
            np.ma.masked_invalid(panel), cmap="viridis", interpolation="nearest", vmin=0, vmax=np.nanmax(stack)
        )
        if numbers:
            for (i, j), value in np.ndenumerate(panel):
                if not np.isnan(value):
                    ax.text(
                        j,
                        i,
                        f"{value:g}",
                        ha="center",
                        va="center",
                        fontsize=8,
                        color="white" if value < np.nanmax(stack) / 2 else "black",
                    )
            ax.set_xticks(range(n))
            ax.set_yticks(range(n))
        fig.colorbar(image, ax=ax, label="relative position RoPE sees")
        ax.set_xlabel("key position j")
        ax.set_ylabel("query position i")
        ax.set_title(
            title if panels == 1 else (panel_titles or [f"group {g}" for g in range(panels)])[index], fontsize=10
        )
    if panels > 1:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path

"""Attention dispersion (Dynamic Drop Attention paper, Figures 1, 2 and 6): as a text grows past the
training window, each query's attention spreads thin -- its largest probabilities shrink.

:func:`measure` runs one forward pass over a long text and records, per layer, the mean over heads
of each sampled query's top-k attention probabilities, with whatever method is applied (plain
RoPE when none); :func:`plot` draws one small panel per layer, one line per method.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .. import plots
from ..integrations.recording import probing
from ..integrations.transformers import applied, apply, remove


@torch.no_grad()
def measure(model, tokenizer, text: str, length: int, points: int = 24, top_k: int = 1) -> dict:
    """Attention dispersion (the DDA paper's Figures 1 and 6) with whatever method is applied to ``model``.

    Args:
        model: a causal language model.
        tokenizer: its tokenizer.
        text: the text; its first ``length`` tokens are read in one prefill.
        length: tokens.
        points: how many query positions to sample, evenly spread.
        top_k: how many of a query's largest attention probabilities to sum.

    Returns:
        ``{"positions": [...], "layers": {layer: [value per position]}}``: per layer the mean over heads
        of each sampled query's top-k probability.
    """
    if points < 2:
        raise ValueError(f"points={points} is out of range: at least 2")
    if top_k < 1:
        raise ValueError(f"top_k={top_k} is out of range: at least 1")
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"][:, :length].to(model.device)
    if ids.shape[1] < length:
        raise ValueError(f"length={length} is out of range: the text has only {ids.shape[1]} tokens")
    rows = torch.linspace(length / points, length - 1, points).long()
    temporary = applied(model) is None
    if temporary:
        apply(model, "rope")  # identical to SDPA, and it lets the probe see the rows
    try:
        with probing(rows, top_k) as record:
            model.get_decoder()(input_ids=ids)
    finally:
        if temporary:
            remove(model)
    return {
        "positions": rows.tolist(),
        "top_k": top_k,
        "layers": {layer: values[0].tolist() for layer, values in sorted(record.items())},
    }


def plot(results: dict[str, dict], path: Path, window: int | None = None) -> Path:
    """One panel per layer: top-k attention probability vs query position, one line per method."""
    series = {
        layer: {label: (r["positions"], r["layers"][layer]) for label, r in results.items()}
        for layer in next(iter(results.values()))["layers"]
    }
    top_k = next(iter(results.values()))["top_k"]
    title = "max attention probability" if top_k == 1 else f"mean of the top-{top_k} attention probabilities"
    return plots.panels(
        series,
        f"{title} vs query position, per layer",
        path,
        xlabel="query position (tokens)",
        marks={"window": window} if window else None,
    )


def save(results: dict[str, dict], path: Path) -> Path:
    path.write_text(json.dumps(results, indent=1))
    return path

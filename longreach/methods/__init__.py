"""The methods: every one by name in :mod:`.registry`, built by :func:`create`; the STRING paper's baseline protocol."""

from __future__ import annotations

from typing import cast

from . import registry, scaling
from .base import Part, PositionMethod
from .registry import REGISTRY, available, create, find, kind_of, names

METHODS: dict[str, type[PositionMethod]] = {
    name: cast(type[PositionMethod], REGISTRY[name])  # a method of kind position is one
    for name in names("position")
}


def paper_baseline(name: str, training_window: int) -> dict:
    """The STRING paper's protocol for extrapolation baselines (section 4.1), as ``apply`` parameters.

    A baseline is set up as if the training window were ``2L/3``, with scale factor ``3/2``. Position
    methods get the defaults they would have at ``2L/3`` (Self-Extend: group size 2, the smallest
    integer >= 3/2); frequency methods get ``factor=1.5`` and, where they take it,
    ``original_max_position_embeddings=2L/3``. ``rope`` and ``string`` are not extrapolation methods:
    they get no parameters.

    Args:
        name: a method name.
        training_window: the model's ``L``.

    Returns:
        The parameters, e.g. ``apply(model, "dca", **paper_baseline("dca", 8192))``.

    Raises:
        ValueError: a method the protocol has no set-up for.
    """
    short = 2 * training_window // 3
    if name in scaling.ALIASES:
        params = {"factor": 1.5}
        if "original_max_position_embeddings" in registry.parameters(find(name)):
            params["original_max_position_embeddings"] = short
        return params
    baselines = {
        "rope": {},
        "string": {},
        "rerope": {"window": short // 2},
        "self_extend": {"group_size": 2, "neighbor_window": short // 4},
        "dca": {"chunk_size": 3 * short // 4, "local_window": short // 8},
    }
    if name not in baselines:
        known = ", ".join([*baselines, *scaling.ALIASES])
        raise ValueError(f"protocol=paper has no set-up for {name!r} (the STRING paper's baselines: {known})")
    return baselines[name]


__all__ = [
    "METHODS",
    "REGISTRY",
    "Part",
    "PositionMethod",
    "available",
    "create",
    "find",
    "kind_of",
    "names",
    "paper_baseline",
]

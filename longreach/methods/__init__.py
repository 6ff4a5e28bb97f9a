"""The methods registry: every method by name, as transformers' ``ROPE_INIT_FUNCTIONS`` does."""

from __future__ import annotations

from dataclasses import MISSING, fields

from . import drop, scaling
from .base import Part, PositionMethod, unknown
from .dca import DualChunk
from .dpe import DPE
from .rerope import ReRope
from .rope import Rope
from .self_extend import SelfExtend
from .string import String

METHODS: dict[str, type[PositionMethod]] = {cls.name: cls for cls in (Rope, String, ReRope, SelfExtend, DualChunk, DPE)}


def names() -> list[str]:
    """Every method name ``apply`` takes: position, frequency and drop methods."""
    return [*METHODS, *scaling.PARAMETERS, *drop.DROPS]


def create(name: str, training_window: int, **params) -> PositionMethod:
    """Build method ``name`` for a model trained on ``training_window`` tokens; parameters are validated."""
    if name not in METHODS:
        raise ValueError(unknown(name, "method", names()))
    cls = METHODS[name]
    allowed = [f.name for f in fields(cls) if f.name != "training_window"]
    unexpected = sorted(set(params) - set(allowed))
    if unexpected:
        raise ValueError(f"{name} has no parameter {', '.join(unexpected)}; its parameters: {', '.join(allowed) or 'none'}")
    return cls(training_window=training_window, **params)


def available() -> list[dict]:
    """Every method longreach has, as ``longreach methods`` prints them.

    Returns:
        One dict per method: ``name``, ``kind`` (position, frequency, drop), ``paper``, ``changes`` (what
        it changes), ``parameters`` (name to default) and ``ranges`` (name to what is allowed).
    """
    rows = []
    for name, cls in METHODS.items():
        params = {f.name: (None if f.default is MISSING else f.default) for f in fields(cls) if f.name != "training_window"}
        rows.append({"name": name, "kind": "position", "paper": cls.paper, "changes": cls.changes,
                     "parameters": params, "ranges": dict(cls.ranges)})
    for name, params in scaling.PARAMETERS.items():
        rows.append({"name": name, "kind": "frequency", "paper": scaling.PAPERS[name],
                     "changes": f"RoPE frequencies: transformers' '{scaling.TRANSFORMERS_TYPE[name]}' rope type"
                     + (" with rope_theta * factor^(d/(d-2))" if name == "ntk" else ""),
                     "parameters": dict(params), "ranges": {k: scaling.RANGES[k] for k in params}})
    for name, cls in drop.DROPS.items():
        params = {f.name: f.default for f in fields(cls)}
        rows.append({"name": name, "kind": "drop", "paper": cls.paper, "changes": drop.CHANGES[name],
                     "parameters": params, "ranges": {k: drop.RANGES[k] for k in params}})
    return rows


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
        if "original_max_position_embeddings" in scaling.PARAMETERS[scaling.ALIASES[name]]:
            params["original_max_position_embeddings"] = short
        return params
    baselines = {
        "rope": {}, "string": {},
        "rerope": {"window": short // 2},
        "self_extend": {"group_size": 2, "neighbor_window": short // 4},
        "dca": {"chunk_size": 3 * short // 4, "local_window": short // 8},
    }
    if name not in baselines:
        known = ", ".join([*baselines, *scaling.ALIASES])
        raise ValueError(f"protocol=paper has no set-up for {name!r} (the STRING paper's baselines: {known})")
    return baselines[name]


__all__ = ["METHODS", "Part", "PositionMethod", "available", "create", "paper_baseline"]

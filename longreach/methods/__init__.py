"""The methods registry: every method by name, as transformers' ``ROPE_INIT_FUNCTIONS`` does."""

from __future__ import annotations

from dataclasses import MISSING, fields

from .base import Part, PositionMethod
from .rope import Rope
from .string import String

METHODS: dict[str, type[PositionMethod]] = {cls.name: cls for cls in (Rope, String)}


def create(name: str, window: int, **params) -> PositionMethod:
    """Build method ``name`` for a model trained on ``window`` tokens; parameters are validated."""
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; supported: {', '.join(METHODS)}")
    cls = METHODS[name]
    allowed = [f.name for f in fields(cls) if f.name != "window"]
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise ValueError(f"{name} has no parameter {', '.join(unknown)}; its parameters: {', '.join(allowed) or 'none'}")
    return cls(window=window, **params)


def available() -> list[dict]:
    """One row per method: name, paper and parameters with their defaults."""
    rows = []
    for name, cls in METHODS.items():
        params = {f.name: (None if f.default is MISSING else f.default) for f in fields(cls) if f.name != "window"}
        rows.append({"name": name, "paper": cls.paper, "parameters": params, "summary": (cls.__doc__ or "").split("\n")[0]})
    return rows


__all__ = ["METHODS", "Part", "PositionMethod", "available", "create"]

"""Every method by name, position, frequency and drop alike, as transformers' ``ROPE_INIT_FUNCTIONS`` maps each
``rope_type`` to its initialiser.

A method is a frozen dataclass that describes itself the way :class:`~longreach.methods.string.String` does:
class attributes ``kind`` (``position``, ``frequency`` or ``drop``), ``name``, ``paper``, ``changes`` (what it
changes) and ``ranges`` (what each parameter allows); its dataclass fields are its parameters with their
defaults, and it validates them when built. A method that needs the training window ``L`` has a
``training_window`` field, which is not a parameter. Adding a method is writing its class and naming it here.
"""

from __future__ import annotations

from dataclasses import MISSING, Field, fields
from typing import Any, ClassVar, Protocol

from . import drop, scaling
from .base import require_int, unknown
from .dca import DualChunk
from .dpe import DPE
from .rerope import ReRope
from .rope import Rope
from .self_extend import SelfExtend
from .string import String


class Method(Protocol):
    """What every method class has: its description, and its parameters as dataclass fields."""

    __dataclass_fields__: ClassVar[dict[str, Field[Any]]]
    kind: ClassVar[str]
    name: ClassVar[str]
    paper: ClassVar[str]
    changes: ClassVar[str]
    ranges: ClassVar[dict[str, str]]

    def __init__(self, **params: Any) -> None: ...


REGISTRY: dict[str, type[Method]] = {
    cls.name: cls for cls in (Rope, String, ReRope, SelfExtend, DualChunk, DPE, *scaling.METHODS, *drop.METHODS)
}


def names(kind: str | None = None) -> list[str]:
    """Every method name ``apply`` takes, or only those of ``kind``."""
    return [name for name, cls in REGISTRY.items() if kind in (None, cls.kind)]


def parameters(cls: type[Method]) -> dict:
    """A method's parameters and their defaults (``None``: derived from ``L``, or required)."""
    return {f.name: None if f.default is MISSING else f.default for f in fields(cls) if f.name != "training_window"}


def _lookup(name: str) -> type[Method] | None:
    return REGISTRY.get(scaling.ALIASES.get(name, name))


def kind_of(name: str) -> str | None:
    """``position``, ``frequency`` or ``drop``: the kind of method ``name`` (or of an alias); ``None`` for no method."""
    cls = _lookup(name)
    return None if cls is None else cls.kind


def find(name: str, kind: str | None = None) -> type[Method]:
    """The class of method ``name`` (or of one of its aliases, e.g. transformers' ``linear`` for ``pi``).

    Raises:
        ValueError: no such method, or none of ``kind``: the nearest names first, then every one of the kind.
    """
    cls = _lookup(name)
    if cls is None or kind not in (None, cls.kind):
        raise ValueError(unknown(name, "method" if kind is None else f"{kind} method", names(kind)))
    return cls


def create(name: str, training_window: int, **params):
    """Build method ``name`` for a model trained on ``training_window`` tokens; parameters are validated.

    Returns:
        A position method (:class:`~longreach.methods.base.PositionMethod`), a frequency method
        (:class:`~longreach.methods.scaling.Scaling`) or a drop method (:mod:`longreach.methods.drop`).

    Raises:
        ValueError: an unknown method or parameter, or a value out of range, in one line.
    """
    cls = find(name)
    allowed = list(parameters(cls))
    unexpected = sorted(set(params) - set(allowed))
    if unexpected:
        raise ValueError(
            f"{cls.name} has no parameter {', '.join(unexpected)}; its parameters: {', '.join(allowed) or 'none'}"
        )
    if any(f.name == "training_window" for f in fields(cls)):
        require_int("training_window", training_window, 2, None, "the model's L, a whole number of tokens >= 2")
        return cls(training_window=training_window, **params)
    return cls(**params)


def available() -> list[dict]:
    """Every method longreach has, as ``longreach methods`` prints them.

    Returns:
        One dict per method: ``name``, ``kind`` (position, frequency, drop), ``paper``, ``changes`` (what
        it changes), ``parameters`` (name to default) and ``ranges`` (name to what is allowed).
    """
    return [
        {
            "name": name,
            "kind": cls.kind,
            "paper": cls.paper,
            "changes": cls.changes,
            "parameters": parameters(cls),
            "ranges": dict(cls.ranges),
        }
        for name, cls in REGISTRY.items()
    ]

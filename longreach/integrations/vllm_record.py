"""A longreach record for vLLM (the ``longreach`` entry of a model's config, :meth:`.applied.Applied.record`'s form):
how :func:`.vllm.overrides` writes it, which methods vLLM runs, and every check that needs no model -- at once in
``overrides``, and as the plugin loads in ``vllm serve``'s first process for a record given on its command line.
"""

from __future__ import annotations

import json
import numbers
from typing import Any

from .. import methods
from ..methods.base import LARGEST, PositionMethod
from ..methods.drop import Drop, DynamicDrop
from ..methods.scaling import Scaling
from . import saved
from .transformers import CONFIG_KEY

# position methods whose parts are the same per layer
SUPPORTED = ("rope", "string", "rerope", "self_extend", "dca", "dpe")
FREQUENCY = ("pi", "ntk", "yarn", "llama3")  # frequency methods: the model's rope_parameters, vLLM's own rotary
DROP = ("drop", "dynamic_drop")  # drop methods: per query, in the layers they name (the CPU backend)


def record_of(method: str, params: dict, training_window: int | None, scaling, drop) -> dict:
    """The record of ``longreach.apply``'s arguments, in :meth:`.applied.Applied.record`'s form: a frequency
    method alone is RoPE with it as ``scaling``, a drop method alone RoPE with it as ``drop``."""
    kind = methods.kind_of(method)
    for other, value in (("frequency", scaling), ("drop", drop)):
        if kind == other and value is not None:
            raise ValueError(f"{method} is a {other} method already; give it with a position method instead")
    if kind == "frequency":
        method, scaling, params = "rope", {"rope_type": method, **params}, {}
    elif kind == "drop":
        method, drop, params = "rope", {"method": method, **params}, {}
    composed = {name: value for name, value in (("scaling", scaling), ("drop", drop)) if value is not None}
    return {"method": method, "params": params, "training_window": training_window, **composed}


def plain(value):
    """``value`` with numpy numbers and arrays as Python's (what ``json`` writes), in lists and dicts too."""
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        return plain(value.tolist())
    if isinstance(value, dict):
        return {key: plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return value
    return int(value) if isinstance(value, numbers.Integral) else float(value)


def runs_attention(record: dict) -> bool:
    """Whether a record changes attention (longreach's backends run it), not only vLLM's rotary embedding: a position
    method other than RoPE, or a drop method."""
    return record["method"] != "rope" or bool(record.get("params")) or bool(record.get("drop"))


def resolve(record: dict, window: int) -> tuple[PositionMethod, Scaling | None, Drop | DynamicDrop | None]:
    """The position, frequency and drop methods a record describes for a model of training window ``window``, or a
    one-line ``ValueError``."""
    check(record)
    window = int(record.get("training_window") or window)
    position = methods.create(record["method"], training_window=window, **(record.get("params") or {}))
    scaling, drop = dict(record.get("scaling") or {}), dict(record.get("drop") or {})
    frequency = methods.create(scaling.pop("rope_type"), window, **scaling) if scaling else None
    dropping = methods.create(drop.pop("method", "drop"), window, **drop) if drop else None
    return position, frequency, dropping


def check(record: dict) -> None:
    """A one-line ``ValueError`` unless vLLM runs what the record asks for: a record of :mod:`.saved`'s fields (its
    ``training_window`` may be null: the model's), of methods that exist and run in vLLM."""
    saved.checked(record, "hf_overrides", window_optional=True)
    methods.find(record["method"])  # an unknown name: the nearest names, then every method
    scaling, drop = record.get("scaling"), record.get("drop")
    named: list[tuple[Any, str | None, tuple[str, ...]]] = [(record["method"], None, SUPPORTED)]  # JSON values
    if scaling:
        named.append((scaling.get("rope_type"), "frequency", FREQUENCY))
    if drop:
        named.append((drop.get("method", "drop"), "drop", DROP))
    for name, kind, allowed in named:
        if kind is not None:
            methods.find(name, kind)  # a method of another kind, or none: its own one-line error
        if name == "dynamic":
            raise ValueError(
                "method='dynamic': vLLM's dynamic NTK fixes its factor at the model's window, longreach's grows it "
                "with each forward pass; use ntk"
            )
        if name is not None and name not in allowed:
            actual = methods.kind_of(name)  # an unknown name: its own one-line error
            raise ValueError(
                f"method={name!r} ({actual}) does not run in vLLM with longreach yet; supported: {', '.join(allowed)}"
            )


def check_without_model(record: dict) -> None:
    """Every check of a record that needs no model, before any engine starts: at the record's own training window
    where it names one; else a one-line ``ValueError`` where the record is wrong at every training window (a wrong name
    or type, a value out of range whatever ``L``), the message of the largest, and a record wrong at some windows only
    is checked when vLLM reads the model's own."""
    check(record)
    if record.get("training_window") is not None:
        resolve(record, record["training_window"])
        return
    errors = []
    for window in (LARGEST, *(1 << k for k in range(30, 0, -1))):
        try:
            resolve(record, window)
            return
        except ValueError as error:
            errors.append(error)
    raise ValueError(str(errors[0]).replace(f"L = {LARGEST}", "L"))


def stray_record(overrides: dict) -> str | None:
    """Why ``overrides`` (vLLM's ``hf_overrides``, or a config's fields) hold a record's fields at the top level, not
    under ``longreach`` (one line showing the right form), or ``None``."""
    if CONFIG_KEY in overrides or not isinstance(overrides.get("method"), str):
        return None
    stray = [key for key in saved.FIELDS if key in overrides]
    if not ({"params", "training_window", "scaling", "drop"} & set(stray)):
        return None
    record = {key: overrides[key] for key in stray}
    return (
        f"hf_overrides: {', '.join(stray)} stand at the top level, where vLLM sets them on the config and longreach "
        f"never reads them: put them under {CONFIG_KEY!r}, as overrides(...).json writes them: "
        f"--hf-overrides '{json.dumps({CONFIG_KEY: record}, default=str)}'"
    )


def command_line_problem(argv: list[str]) -> str | None:
    """Why the record of a ``vllm serve --hf-overrides '<JSON>'`` command line cannot run (one line), or ``None``: its
    fields at the top level, or the record wrong at every training window; checked as the plugin loads in vLLM's first
    process, before any engine or worker starts. JSON vLLM cannot read is left to vLLM's own message."""
    given = [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg in ("--hf-overrides", "--hf_overrides")]
    given += [arg.split("=", 1)[1] for arg in argv if arg.startswith(("--hf-overrides=", "--hf_overrides="))]
    for text in given:
        try:
            overrides = json.loads(text)
        except ValueError:
            continue
        if not isinstance(overrides, dict):
            continue
        if problem := stray_record(overrides):
            return problem
        if CONFIG_KEY in overrides:
            try:
                check_without_model(overrides[CONFIG_KEY])
            except ValueError as error:
                return str(error)
    return None

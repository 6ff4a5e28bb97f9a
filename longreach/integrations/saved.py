"""The ``longreach`` record a saved model's ``config.json`` holds (:meth:`.applied.Applied.record`), checked before
it is used.

:func:`longreach.load` re-applies what the record says. A record edited by hand, damaged, or written by something
else is refused in one line that names the file, the field and what is allowed -- before any weights load.
What the fields' values mean (a method's parameters, a frequency or drop method) is checked by ``apply`` itself.
"""

from __future__ import annotations

import numbers

FIELDS = {  # field: (required, what is allowed)
    "method": (True, "a method name (see longreach.available())"),
    "training_window": (True, "an integer >= 2 (tokens)"),
    "params": (False, "a dict of the method's parameters"),
    "scaling": (False, 'null or a dict such as {"rope_type": "yarn", "factor": 2.0}'),
    "drop": (False, 'null or a dict such as {"method": "dynamic_drop"}'),
    "replaced_rope_parameters": (False, "null or the model's own rope_parameters (a dict)"),
}

FORMER = ("backend",)  # fields earlier versions saved, read and ignored (the backend is chosen where a model loads)


def checked(record, where: str, window_optional: bool = False) -> dict:
    """``record`` (the ``longreach`` entry of ``where``: a config.json, or vLLM's ``hf_overrides``, whose
    ``training_window`` may be null, ``window_optional``: the model's) if well formed; else one ``ValueError`` line."""
    if not isinstance(record, dict):
        raise ValueError(
            f"{where}: the 'longreach' record is {type(record).__name__} {_short(record)}; "
            f"allowed: a dict with {', '.join(FIELDS)}"
        )
    unknown = sorted(set(record) - set(FIELDS) - set(FORMER), key=str)
    if unknown:
        raise ValueError(
            f"{where}: the 'longreach' record has no field {unknown[0]!r}; its fields: {', '.join(FIELDS)}"
        )
    for field, (required, allowed) in FIELDS.items():
        value = record.get(field)
        if field not in record:
            if required and not (field == "training_window" and window_optional):
                raise ValueError(f"{where}: the 'longreach' record has no '{field}'; allowed: {allowed}")
            continue
        if not _fits(field, value, window_optional):
            raise ValueError(f"{where}: the 'longreach' record's '{field}' is {_short(value)}; allowed: {allowed}")
    return record


def _fits(field: str, value, window_optional: bool) -> bool:
    if field == "method":
        return isinstance(value, str)
    if field == "training_window":
        if value is None:
            return window_optional
        return isinstance(value, numbers.Integral) and not isinstance(value, bool) and int(value) >= 2
    if field == "params":
        return isinstance(value, dict) or (value is None and window_optional)
    return value is None or isinstance(value, dict)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."

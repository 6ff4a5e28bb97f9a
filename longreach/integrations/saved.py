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


def checked(record, where: str) -> dict:
    """``record`` (the ``longreach`` entry of ``where``, a config.json) if well formed; else one ``ValueError`` line."""
    if not isinstance(record, dict):
        raise ValueError(
            f"{where}: the 'longreach' record is {type(record).__name__} {_short(record)}; "
            f"allowed: a dict with {', '.join(FIELDS)}"
        )
    for field, (required, allowed) in FIELDS.items():
        value = record.get(field)
        if field not in record:
            if required:
                raise ValueError(f"{where}: the 'longreach' record has no '{field}'; allowed: {allowed}")
            continue
        if not _fits(field, value):
            raise ValueError(f"{where}: the 'longreach' record's '{field}' is {_short(value)}; allowed: {allowed}")
    return record


def _fits(field: str, value) -> bool:
    if field == "method":
        return isinstance(value, str)
    if field == "training_window":
        return isinstance(value, numbers.Integral) and not isinstance(value, bool) and int(value) >= 2
    if field == "params":
        return isinstance(value, dict)
    return value is None or isinstance(value, dict)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."

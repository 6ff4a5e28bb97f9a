"""A method as the command line names it: ``string:shift=2731,local_window=128`` -> :class:`MethodSpec`.

A spec is text and parameters only: what ``longreach.apply`` is called with (:meth:`MethodSpec.arguments`).
Applying one to a model is :func:`longreach.eval.on_model.apply`'s job, above the integration with transformers.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MethodSpec:
    """A method and its parameters as written on the command line: ``string:shift=2731,local_window=128``.

    Lists take ``;``: ``drop:rate=0.3,layers=0;1;2``. ``MethodSpec.parse(text)`` reads one."""

    name: str
    params: tuple[tuple[str, object], ...] = ()

    @classmethod
    def parse(cls, text: str) -> MethodSpec:
        name, _, rest = text.partition(":")
        params = {}
        for item in filter(None, rest.split(",")):
            key, sep, value = item.partition("=")
            if not sep or not key.strip():
                raise ValueError(f"method parameter {item!r} must look like name=value (in {text!r})")
            if key.strip() in params:
                raise ValueError(f"method parameter {key.strip()!r} is given twice (in {text!r}); give it once")
            params[key.strip()] = parse_value(value.strip())
        if not name.strip():
            raise ValueError(f"--method {text!r} names no method; see `longreach methods`")
        return cls(name.strip(), tuple(sorted(params.items())))

    def arguments(self, training_window: int) -> tuple[str, dict]:
        """``(method, kwargs)`` for ``longreach.apply``.

        ``protocol=paper`` expands to the STRING paper's baseline set-up; ``position+frequency``
        (e.g. ``string+yarn:factor=2``) composes, routing each parameter to the method that has it.
        """
        from . import base, paper_baseline, scaling

        params = dict(self.params)
        protocol = params.pop("protocol", None)
        if protocol not in (None, "paper"):
            raise ValueError(f"protocol={protocol!r} is not one of: paper")
        position, _, frequency = self.name.partition("+")
        if protocol:
            params = {**paper_baseline(frequency or position, training_window), **params}
        if not frequency:
            return position, params
        if frequency not in scaling.ALIASES:
            raise ValueError(f"after '+': {base.unknown(frequency, 'frequency method', list(scaling.PARAMETERS))}")
        names = scaling.PARAMETERS[scaling.ALIASES[frequency]]
        rescale = {"rope_type": frequency, **{k: v for k, v in params.items() if k in names}}
        return position, {"scaling": rescale, **{k: v for k, v in params.items() if k not in names}}

    @property
    def label(self) -> str:
        return self.name + (":" + ",".join(f"{k}={_written(v)}" for k, v in self.params) if self.params else "")


def _written(value) -> str:
    """A parameter's value as :func:`parse_value` reads it back (a tuple as ``0;1;2``)."""
    return ";".join(map(str, value)) if isinstance(value, tuple) else str(value)


def parse_value(text: str):
    """A parameter's value as written: ``0;1;2`` a tuple, then an int, a float, true/false/none, else the text."""
    if ";" in text:  # a list, e.g. layers=0;1;2
        return tuple(parse_value(item) for item in text.split(";") if item)
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(text.lower(), text)

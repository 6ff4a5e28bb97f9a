"""longreach: measure and extend the context RoPE language models really use.

    import longreach
    longreach.apply(model, "string")          # STRING, shift round(L/3), local window min(128, L // 16)
    longreach.apply(model, "dca", scaling={"rope_type": "yarn", "factor": 2.0})   # compose
    longreach.remove(model)                   # back to the model's own attention and frequencies
    model, tokenizer = longreach.load(path)   # a model saved after apply comes back applied

The public names are imported on first use (module ``__getattr__``), so ``import longreach`` and the
``longreach`` command's ``--help`` do not import torch or transformers. Any use of ``apply`` goes through
``longreach.integrations.transformers``, whose import registers longreach's attention with transformers.
"""

import importlib
from typing import TYPE_CHECKING

from .provenance import VERSION

if TYPE_CHECKING:  # what the names are, for readers and tools (the API reference); imported on first use below
    from .inspection import inspect
    from .integrations.transformers import applied, apply, describe, remove, training_window
    from .methods import available
    from .models import load

__version__ = VERSION
__all__ = ["applied", "apply", "available", "describe", "inspect", "load", "remove", "training_window"]

_HOMES = {
    "applied": ".integrations.transformers",
    "apply": ".integrations.transformers",
    "describe": ".integrations.transformers",
    "remove": ".integrations.transformers",
    "training_window": ".integrations.transformers",
    "available": ".methods",
    "inspect": ".inspection",
    "load": ".models",
}


def __getattr__(name: str):
    """A public name, imported from its module on first use; or a subpackage (``longreach.methods``), as a plain
    ``import longreach`` used to import them all."""
    if name in _HOMES:
        value = getattr(importlib.import_module(_HOMES[name], __name__), name)
        globals()[name] = value  # imported once
        return value
    try:
        return importlib.import_module(f".{name}", __name__)
    except ModuleNotFoundError as error:
        if error.name != f"{__name__}.{name}":  # the module exists and lacks something: say that
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])

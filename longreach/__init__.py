"""longreach: measure and extend the context RoPE language models really use.

    import longreach
    longreach.apply(model, "string")          # STRING, shift round(L/3), local window 128
    longreach.apply(model, "dca", scaling={"rope_type": "yarn", "factor": 2.0})   # compose
    longreach.remove(model)                   # back to the model's own attention and frequencies
"""

from .integrations.transformers import applied, apply, describe, remove, training_window
from .methods import available

__version__ = "0.1.0"
__all__ = ["applied", "apply", "available", "describe", "remove", "training_window"]

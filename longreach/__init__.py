"""longreach: measure and extend the context RoPE language models really use.

    import longreach
    longreach.apply(model, "string")          # STRING, shift round(L/3), local window 128
    longreach.apply(model, "dca", scaling={"rope_type": "yarn", "factor": 2.0})   # compose
    longreach.remove(model)                   # back to the model's own attention and frequencies
    model, tokenizer = longreach.load(path)   # a model saved after apply comes back applied
"""

from .integrations.transformers import applied, apply, describe, remove, training_window
from .methods import available
from .models import load

__version__ = "0.1.0"
__all__ = ["applied", "apply", "available", "describe", "load", "remove", "training_window"]

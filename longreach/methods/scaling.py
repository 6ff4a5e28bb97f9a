"""RoPE frequency methods, done by transformers' own initialisers (``ROPE_INIT_FUNCTIONS``).

These are not position rules: they change RoPE's frequencies. longreach only writes the
``rope_parameters`` and lets transformers rebuild the rotary embedding, so the formulas are
transformers' own:

* ``pi`` -- position interpolation (Chen et al. 2023, arXiv:2306.15595): transformers' ``linear``;
* ``ntk`` -- NTK-aware scaling (bloc97, r/LocalLLaMA 2023): the base becomes
  ``theta * factor^(d / (d - 2))`` with ``d`` the rotary dimension, under transformers' ``default``;
* ``dynamic`` -- dynamic NTK (emozilla 2023): transformers' ``dynamic``;
* ``yarn`` -- YaRN (Peng et al. 2023, arXiv:2309.00071): transformers' ``yarn``;
* ``llama3`` -- Llama 3.1's scaling (Llama Team 2024): transformers' ``llama3``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .base import require_int, require_number

PARAMETERS = {
    "pi": {"factor": 2.0},
    "ntk": {"factor": 2.0},
    "dynamic": {"factor": 2.0},
    "yarn": {"factor": 2.0, "original_max_position_embeddings": None, "beta_fast": 32.0, "beta_slow": 1.0, "attention_factor": None},
    "llama3": {"factor": 8.0, "original_max_position_embeddings": None, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
}
PAPERS = {
    "pi": "Chen et al. 2023, Position Interpolation (arXiv:2306.15595)",
    "ntk": "bloc97 2023, NTK-Aware Scaled RoPE (r/LocalLLaMA)",
    "dynamic": "emozilla 2023, Dynamically Scaled RoPE (r/LocalLLaMA)",
    "yarn": "Peng et al. 2023, YaRN (arXiv:2309.00071)",
    "llama3": "Llama Team 2024, The Llama 3 Herd of Models (arXiv:2407.21783)",
}
RANGES = {
    "factor": "number >= 1",
    "original_max_position_embeddings": "positive integer (default: the model's L)",
    "beta_fast": "a number > 0 (YaRN's high-frequency boundary)",
    "beta_slow": "a number > 0 (YaRN's low-frequency boundary)",
    "attention_factor": "a number > 0, or None (YaRN's 0.1 ln s + 1)",
    "low_freq_factor": "a number > 0",
    "high_freq_factor": "a number > low_freq_factor",
}
TRANSFORMERS_TYPE = {"pi": "linear", "ntk": "default", "dynamic": "dynamic", "yarn": "yarn", "llama3": "llama3"}
ALIASES = {"linear": "pi", "pi": "pi", "ntk": "ntk", "dynamic": "dynamic", "yarn": "yarn", "llama3": "llama3"}


@dataclass(frozen=True)
class Scaling:
    """A validated frequency method: its name and parameters (defaults filled, ``None``: from the model)."""

    name: str
    params: dict = field(default_factory=dict)

    @classmethod
    def create(cls, name: str, training_window: int, **params) -> "Scaling":
        name = ALIASES.get(name, name)
        if name not in PARAMETERS:
            raise ValueError(f"unknown frequency method {name!r}; supported: {', '.join(PARAMETERS)}")
        unknown = sorted(set(params) - set(PARAMETERS[name]))
        if unknown:
            raise ValueError(f"{name} has no parameter {', '.join(unknown)}; its parameters: {', '.join(PARAMETERS[name])}")
        merged = {**PARAMETERS[name], **params}
        require_number("factor", merged["factor"], "a number >= 1", low=1)
        for key in ("beta_fast", "beta_slow"):
            if key in merged:
                require_number(key, merged[key], RANGES[key], low=0, low_open=True)
        if merged.get("attention_factor") is not None:
            require_number("attention_factor", merged["attention_factor"], RANGES["attention_factor"], low=0, low_open=True)
        if "low_freq_factor" in merged:
            require_number("low_freq_factor", merged["low_freq_factor"], RANGES["low_freq_factor"], low=0, low_open=True)
            require_number("high_freq_factor", merged["high_freq_factor"], RANGES["high_freq_factor"],
                           low=merged["low_freq_factor"], low_open=True)
        if "original_max_position_embeddings" in merged:
            if merged["original_max_position_embeddings"] is None:
                merged["original_max_position_embeddings"] = training_window
            require_int("original_max_position_embeddings", merged["original_max_position_embeddings"], 1, None, RANGES["original_max_position_embeddings"])
        return cls(name, merged)

    def rope_parameters(self, current: dict, rotary_dims: int) -> dict:
        """The model's ``rope_parameters`` with this method written in, for transformers to initialise."""
        params = {k: v for k, v in self.params.items() if v is not None}
        base = {k: v for k, v in current.items() if k in ("rope_theta", "partial_rotary_factor")}
        if self.name == "ntk":
            d = rotary_dims
            return {**base, "rope_type": "default", "rope_theta": base["rope_theta"] * params["factor"] ** (d / (d - 2))}
        return {**base, "rope_type": TRANSFORMERS_TYPE[self.name], **{k: float(v) if k != "original_max_position_embeddings" else v for k, v in params.items()}}

    def describe(self) -> str:
        return f"{self.name}(" + ", ".join(f"{k}={v}" for k, v in self.params.items()) + ")"

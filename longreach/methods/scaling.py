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

A model that already scales its frequencies (every Llama 3.1/3.2/3.3 with ``llama3``, Qwen with
``yarn``, a ``linear`` model) keeps that scaling: ``pi``, ``ntk`` and ``yarn`` compose over it
(:meth:`Scaling.over`, each a map on the model's own frequencies); ``dynamic`` and ``llama3`` on top
of another scaling, or anything over a ``dynamic`` or ``longrope`` model (whose frequencies change
during the forward pass), are refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .base import require_int, require_number, unknown

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
    "beta_fast": "a number > beta_slow (YaRN's high-frequency boundary)",
    "beta_slow": "a number > 0 (YaRN's low-frequency boundary)",
    "attention_factor": "a number > 0, or None (YaRN's 0.1 ln s + 1)",
    "low_freq_factor": "a number > 0",
    "high_freq_factor": "a number > low_freq_factor",
}
TRANSFORMERS_TYPE = {"pi": "linear", "ntk": "default", "dynamic": "dynamic", "yarn": "yarn", "llama3": "llama3"}
ALIASES = {"linear": "pi", "pi": "pi", "ntk": "ntk", "dynamic": "dynamic", "yarn": "yarn", "llama3": "llama3"}
COMPOSABLE = ("pi", "ntk", "yarn")  # the methods defined as a map on any set of frequencies
STATIC_TYPES = ("linear", "yarn", "llama3")  # a model's own scalings whose frequencies stay fixed during a forward


@dataclass(frozen=True)
class Scaling:
    """A validated frequency method, built by ``apply(model, "yarn", ...)`` or ``scaling={...}``.

    Args:
        name: ``pi``, ``ntk``, ``dynamic``, ``yarn`` or ``llama3``.
        params: its parameters, defaults filled in (``None``: taken from the model, e.g. ``L``).
    """

    name: str
    params: dict = field(default_factory=dict)

    @classmethod
    def create(cls, name: str, training_window: int, **params) -> "Scaling":
        name = ALIASES.get(name, name)
        if name not in PARAMETERS:
            raise ValueError(unknown(name, "frequency method", list(PARAMETERS)))
        unexpected = sorted(set(params) - set(PARAMETERS[name]))
        if unexpected:
            raise ValueError(f"{name} has no parameter {', '.join(unexpected)}; its parameters: {', '.join(PARAMETERS[name])}")
        merged = {**PARAMETERS[name], **params}
        require_number("factor", merged["factor"], "a number >= 1", low=1)
        if "beta_slow" in merged:
            require_number("beta_slow", merged["beta_slow"], RANGES["beta_slow"], low=0, low_open=True)
            require_number("beta_fast", merged["beta_fast"], f"a number > beta_slow = {merged['beta_slow']}",
                           low=merged["beta_slow"], low_open=True)
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
            try:
                theta = base["rope_theta"] * params["factor"] ** (d / (d - 2))
            except OverflowError:
                theta = math.inf
            if not math.isfinite(theta):
                raise ValueError(f"factor={params['factor']!r} is out of range: rope_theta x factor^(d/(d-2)) overflows")
            return {**base, "rope_type": "default", "rope_theta": theta}
        return {**base, "rope_type": TRANSFORMERS_TYPE[self.name], **{k: float(v) if k != "original_max_position_embeddings" else v for k, v in params.items()}}

    def over(self, inv_freq: torch.Tensor, attention_scaling: float, own: dict) -> tuple[torch.Tensor, float]:
        """This method composed over a model's own scaled frequencies ``inv_freq`` (``own``: its
        ``rope_parameters``, whose ``rope_type`` is one of :data:`STATIC_TYPES`): the new ``inv_freq`` and
        attention scaling. Each method is a map on frequencies, exact for RoPE's default ones:

        * ``pi``: ``theta_k / s`` (Chen et al. 2023, Eq. 2: position ``m`` read as ``m / s``);
        * ``ntk``: ``theta_k s^(-2k / (d - 2))``, the base change ``b -> b s^(d / (d - 2))`` written per pair;
        * ``yarn``: NTK-by-parts with YaRN's temperature (Peng et al. 2023, Eq. 18-20): with ``r_k = L theta_k
          / 2 pi`` rotations over the original window ``L``, ``gamma_k = clamp((ln r_k - ln beta_slow) /
          (ln beta_fast - ln beta_slow), 0, 1)`` and ``theta'_k = theta_k (gamma_k + (1 - gamma_k) / s)``;
          the cos and sin gain ``0.1 ln s + 1`` (or ``attention_factor``) on top of the model's own. On
          default frequencies this equals transformers' ``yarn`` with ``truncate=False``, whose ramp is
          linear in the pair index, which is linear in ``ln r_k`` there.
        """
        if self.name not in COMPOSABLE:
            raise ValueError(
                f"{self.name} over the model's own {describe_own(own)} scaling is not defined; "
                f"compose {', '.join(COMPOSABLE)} with it, or apply a position method alone"
            )
        s = self.params["factor"]
        theta = inv_freq.double()
        if self.name == "pi":
            scaled = theta / s
        elif self.name == "ntk":
            pairs = torch.arange(theta.shape[-1], dtype=torch.float64, device=theta.device)
            scaled = theta * torch.exp(-2 * pairs / (2 * theta.shape[-1] - 2) * math.log(s))
        else:
            rotations = self.params["original_max_position_embeddings"] * theta / (2 * math.pi)
            slow, fast = math.log(self.params["beta_slow"]), math.log(self.params["beta_fast"])
            gamma = ((rotations.log() - slow) / (fast - slow)).clamp(0, 1)
            scaled = theta * (gamma + (1 - gamma) / s)
            gain = self.params["attention_factor"]
            attention_scaling = attention_scaling * (gain if gain is not None else 0.1 * math.log(s) + 1 if s > 1 else 1.0)
        return scaled.to(inv_freq.dtype), attention_scaling

    def describe(self) -> str:
        return f"{self.name}(" + ", ".join(f"{k}={v}" for k, v in self.params.items()) + ")"


def describe_own(own: dict) -> str:
    """``rope_type='llama3' (factor=8.0, ...)``: a model's own ``rope_parameters``, for errors."""
    values = ", ".join(f"{k}={v}" for k, v in own.items() if k not in ("rope_type", "rope_theta"))
    return f"rope_type={own.get('rope_type')!r}" + (f" ({values})" if values else "")

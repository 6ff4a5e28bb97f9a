"""RoPE frequency methods, done by transformers' own initialisers (``ROPE_INIT_FUNCTIONS``).

These are not position rules: they change RoPE's frequencies. longreach only writes the
``rope_parameters`` and lets transformers rebuild the rotary embedding, so the formulas are
transformers' own. Each method is one class below, described the way the position methods are
(``name``, ``paper``, ``changes``, ``ranges``, its parameters as dataclass fields with their defaults):

* :class:`PI` -- position interpolation (Chen et al. 2023, arXiv:2306.15595): transformers' ``linear``;
* :class:`NTK` -- NTK-aware scaling (bloc97, r/LocalLLaMA 2023): the base becomes
  ``theta * factor^(d / (d - 2))`` with ``d`` the rotary dimension, under transformers' ``default``;
* :class:`Dynamic` -- dynamic NTK (emozilla 2023): transformers' ``dynamic``;
* :class:`Yarn` -- YaRN (Peng et al. 2023, arXiv:2309.00071): transformers' ``yarn``;
* :class:`Llama3` -- Llama 3.1's scaling (Llama Team 2024): transformers' ``llama3``.

A model that already scales its frequencies (every Llama 3.1/3.2/3.3 with ``llama3``, Qwen with
``yarn``, a ``linear`` model) keeps that scaling: ``pi``, ``ntk`` and ``yarn`` compose over it
(:meth:`Scaling.over`, each a map on the model's own frequencies); ``dynamic`` and ``llama3`` on top
of another scaling, or anything over a ``dynamic`` or ``longrope`` model (whose frequencies change
during the forward pass), are refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import ClassVar

import torch

from .base import require_int, require_number

FACTOR = "number >= 1"
ORIGINAL_WINDOW = "positive integer (default: the model's L)"


@dataclass(frozen=True)
class Scaling:
    """A frequency method, built by ``apply(model, "yarn", ...)`` or ``scaling={...}`` and validated when built.

    Args:
        training_window: the model's ``L`` (the default ``original_max_position_embeddings``).
        factor: the scale factor ``s >= 1``.
    """

    kind: ClassVar[str] = "frequency"
    name: ClassVar[str]
    paper: ClassVar[str]
    changes: ClassVar[str]
    ranges: ClassVar[dict[str, str]]
    transformers_type: ClassVar[str]
    """The ``rope_type`` transformers' ``ROPE_INIT_FUNCTIONS`` builds the frequencies with."""
    aliases: ClassVar[tuple[str, ...]] = ()
    """Other names the method goes by (transformers' ``rope_type``, where it differs)."""

    training_window: int
    factor: float = 2.0

    def __post_init__(self) -> None:
        require_number("factor", self.factor, "a number >= 1", low=1)

    @property
    def params(self) -> dict:
        """Its parameters, defaults filled in (``original_max_position_embeddings``: ``L`` unless given)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "training_window"}

    def rope_parameters(self, current: dict, rotary_dims: int) -> dict:
        """The model's ``rope_parameters`` with this method written in, for transformers to initialise."""
        base = {k: v for k, v in current.items() if k in ("rope_theta", "partial_rotary_factor")}
        params = {
            k: v if k == "original_max_position_embeddings" else float(v)
            for k, v in self.params.items()
            if v is not None
        }
        return {**base, "rope_type": self.transformers_type, **params}

    def over(self, inv_freq: torch.Tensor, attention_scaling: float, own: dict) -> tuple[torch.Tensor, float]:
        """This method composed over a model's own scaled frequencies ``inv_freq`` (``own``: its
        ``rope_parameters``, whose ``rope_type`` is one of :data:`STATIC_TYPES`): the new ``inv_freq`` and
        attention scaling. Each composable method is a map on frequencies (:meth:`rescale`), exact for
        RoPE's default ones."""
        scaled, gain = self.rescale(inv_freq.double(), own)
        return scaled.to(inv_freq.dtype), attention_scaling * gain

    def rescale(self, theta: torch.Tensor, own: dict) -> tuple[torch.Tensor, float]:
        """``(theta', gain)``: the frequencies ``theta [pairs]`` (float64) mapped by this method, and the factor
        on the attention scaling. Methods that are no map on any set of frequencies refuse."""
        raise ValueError(
            f"{self.name} over the model's own {describe_own(own)} scaling is not defined; "
            f"compose {', '.join(COMPOSABLE)} with it, or apply a position method alone"
        )

    def describe(self) -> str:
        return f"{self.name}(" + ", ".join(f"{k}={v}" for k, v in self.params.items()) + ")"


def _original_window(method: Yarn | Llama3) -> None:
    """Fill ``original_max_position_embeddings`` with ``L`` unless given, and check it."""
    if method.original_max_position_embeddings is None:
        object.__setattr__(method, "original_max_position_embeddings", method.training_window)
    require_int("original_max_position_embeddings", method.original_max_position_embeddings, 1, None, ORIGINAL_WINDOW)


@dataclass(frozen=True)
class PI(Scaling):
    """Position interpolation (Chen et al. 2023, Eq. 2): position ``m`` read as ``m / s``, i.e. ``theta_k / s``."""

    name = "pi"
    paper = "Chen et al. 2023, Position Interpolation (arXiv:2306.15595)"
    changes = "RoPE frequencies: transformers' 'linear' rope type"
    ranges = {"factor": FACTOR}
    transformers_type = "linear"
    aliases = ("linear",)

    def rescale(self, theta: torch.Tensor, own: dict) -> tuple[torch.Tensor, float]:
        return theta / self.factor, 1.0


@dataclass(frozen=True)
class NTK(Scaling):
    """NTK-aware scaling (bloc97 2023): the base ``b -> b s^(d / (d - 2))``, ``d`` the rotary dimension."""

    name = "ntk"
    paper = "bloc97 2023, NTK-Aware Scaled RoPE (r/LocalLLaMA)"
    changes = "RoPE frequencies: transformers' 'default' rope type with rope_theta * factor^(d/(d-2))"
    ranges = {"factor": FACTOR}
    transformers_type = "default"

    def rope_parameters(self, current: dict, rotary_dims: int) -> dict:
        d = rotary_dims
        try:
            theta = current["rope_theta"] * self.factor ** (d / (d - 2))
        except OverflowError:
            theta = math.inf
        if not math.isfinite(theta):
            raise ValueError(f"factor={self.factor!r} is out of range: rope_theta x factor^(d/(d-2)) overflows")
        base = {k: v for k, v in current.items() if k in ("rope_theta", "partial_rotary_factor")}
        return {**base, "rope_type": self.transformers_type, "rope_theta": theta}

    def rescale(self, theta: torch.Tensor, own: dict) -> tuple[torch.Tensor, float]:
        """The base change written per pair: ``theta_k s^(-2k / (d - 2))``."""
        pairs = torch.arange(theta.shape[-1], dtype=torch.float64, device=theta.device)
        return theta * torch.exp(-2 * pairs / (2 * theta.shape[-1] - 2) * math.log(self.factor)), 1.0


@dataclass(frozen=True)
class Dynamic(Scaling):
    """Dynamic NTK (emozilla 2023): NTK with the factor grown from each forward's longest sequence."""

    name = "dynamic"
    paper = "emozilla 2023, Dynamically Scaled RoPE (r/LocalLLaMA)"
    changes = "RoPE frequencies: transformers' 'dynamic' rope type"
    ranges = {"factor": FACTOR}
    transformers_type = "dynamic"


@dataclass(frozen=True)
class Yarn(Scaling):
    """YaRN (Peng et al. 2023): NTK-by-parts interpolation and the ``0.1 ln s + 1`` attention temperature.

    Args:
        original_max_position_embeddings: the window ``L`` the ramp counts rotations over (default: the model's).
        beta_fast: the high-frequency boundary (rotations per window).
        beta_slow: the low-frequency boundary.
        attention_factor: the gain on cos and sin (``None``: ``0.1 ln s + 1``).
    """

    name = "yarn"
    paper = "Peng et al. 2023, YaRN (arXiv:2309.00071)"
    changes = "RoPE frequencies: transformers' 'yarn' rope type"
    ranges = {
        "factor": FACTOR,
        "original_max_position_embeddings": ORIGINAL_WINDOW,
        "beta_fast": "a number > beta_slow (YaRN's high-frequency boundary)",
        "beta_slow": "a number > 0 (YaRN's low-frequency boundary)",
        "attention_factor": "a number > 0, or None (YaRN's 0.1 ln s + 1)",
    }
    transformers_type = "yarn"

    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        require_number("beta_slow", self.beta_slow, self.ranges["beta_slow"], low=0, low_open=True)
        require_number(
            "beta_fast", self.beta_fast, f"a number > beta_slow = {self.beta_slow}", low=self.beta_slow, low_open=True
        )
        if self.attention_factor is not None:
            require_number(
                "attention_factor", self.attention_factor, self.ranges["attention_factor"], low=0, low_open=True
            )
        _original_window(self)

    def rescale(self, theta: torch.Tensor, own: dict) -> tuple[torch.Tensor, float]:
        """NTK-by-parts with YaRN's temperature (Peng et al. 2023, Eq. 18-20): with ``r_k = L theta_k / 2 pi``
        rotations over the original window ``L``, ``gamma_k = clamp((ln r_k - ln beta_slow) / (ln beta_fast -
        ln beta_slow), 0, 1)`` and ``theta'_k = theta_k (gamma_k + (1 - gamma_k) / s)``; the cos and sin gain
        ``0.1 ln s + 1`` (or ``attention_factor``) on top of the model's own. On default frequencies this
        equals transformers' ``yarn`` with ``truncate=False``, whose ramp is linear in the pair index, which
        is linear in ``ln r_k`` there."""
        s, original = self.factor, self.original_max_position_embeddings
        assert original is not None  # set in __post_init__
        rotations = original * theta / (2 * math.pi)
        slow, fast = math.log(self.beta_slow), math.log(self.beta_fast)
        gamma = ((rotations.log() - slow) / (fast - slow)).clamp(0, 1)
        gain = self.attention_factor if self.attention_factor is not None else 0.1 * math.log(s) + 1 if s > 1 else 1.0
        return theta * (gamma + (1 - gamma) / s), gain


@dataclass(frozen=True)
class Llama3(Scaling):
    """Llama 3.1's piecewise scaling (Llama Team 2024): transformers' ``llama3``.

    Args:
        original_max_position_embeddings: the window before scaling (default: the model's ``L``).
        low_freq_factor: wavelengths beyond ``original / low_freq_factor`` are divided by ``factor``.
        high_freq_factor: wavelengths below ``original / high_freq_factor`` stay; between them, a blend.
    """

    name = "llama3"
    paper = "Llama Team 2024, The Llama 3 Herd of Models (arXiv:2407.21783)"
    changes = "RoPE frequencies: transformers' 'llama3' rope type"
    ranges = {
        "factor": FACTOR,
        "original_max_position_embeddings": ORIGINAL_WINDOW,
        "low_freq_factor": "a number > 0",
        "high_freq_factor": "a number > low_freq_factor",
    }
    transformers_type = "llama3"

    factor: float = 8.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0

    def __post_init__(self) -> None:
        super().__post_init__()
        require_number("low_freq_factor", self.low_freq_factor, self.ranges["low_freq_factor"], low=0, low_open=True)
        require_number(
            "high_freq_factor",
            self.high_freq_factor,
            self.ranges["high_freq_factor"],
            low=self.low_freq_factor,
            low_open=True,
        )
        _original_window(self)


METHODS: tuple[type[Scaling], ...] = (PI, NTK, Dynamic, Yarn, Llama3)
COMPOSABLE = tuple(cls.name for cls in METHODS if cls.rescale is not Scaling.rescale)  # maps on any frequencies
STATIC_TYPES = ("linear", "yarn", "llama3")  # a model's own scalings whose frequencies stay fixed during a forward
ALIASES = {alias: cls.name for cls in METHODS for alias in (*cls.aliases, cls.name)}  # every name -> its method
PARAMETERS = {cls.name: {f.name: f.default for f in fields(cls) if f.name != "training_window"} for cls in METHODS}
"""Each method's parameters and defaults, which a method spec such as ``string+yarn:factor=2`` routes by."""


def describe_own(own: dict) -> str:
    """``rope_type='llama3' (factor=8.0, ...)``: a model's own ``rope_parameters``, for errors."""
    values = ", ".join(f"{k}={v}" for k, v in own.items() if k not in ("rope_type", "rope_theta"))
    return f"rope_type={own.get('rope_type')!r}" + (f" ({values})" if values else "")

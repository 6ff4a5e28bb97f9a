"""longreach in vLLM: a general plugin, no fork. A model whose config carries a ``longreach`` record runs its method.

The entry point (``vllm.general_plugins``, pyproject.toml) is :func:`register`, which vLLM calls in its main, engine
and worker processes: it puts :mod:`.vllm_cpu`'s backend in place of vLLM's CPU attention backend (on the CPU the
platform always takes ``CPU_ATTN``). That backend is vLLM's own for every model without a record. A record comes
from :func:`overrides` (``LLM(model, hf_overrides=longreach.integrations.vllm.overrides("string"))``, or the same
JSON for ``vllm serve --hf-overrides``) or from a model folder saved after ``longreach.apply``, whose config holds
it already (:meth:`.transformers.Applied.record`). A record given as JSON (``vllm serve``) is checked where the
engine starts; one from :func:`overrides` in the main process, against the model's config, before any engine.

Not yet here (each refused in one line): frequency methods (PI, NTK, YaRN, llama3: give vLLM ``rope_parameters``),
drop methods, DPE's per-head pairs, a logit scale (``mscale``); a CUDA backend.
"""

from __future__ import annotations

import json

import torch

from .. import methods
from ..methods.base import PositionMethod
from .transformers import CONFIG_KEY

SUPPORTED = ("rope", "string", "rerope", "self_extend", "dca")  # position methods whose parts are the same per layer


class Overrides:
    """vLLM's ``hf_overrides`` for a longreach method: a callable, which vLLM calls on the model's config in the main
    process before any engine starts -- the record is checked against the model's own window there (one-line
    ``ValueError``) and set on the config. :attr:`json` is the same for ``vllm serve --hf-overrides``."""

    def __init__(self, record: dict):
        self.record = record

    @property
    def json(self) -> str:
        """``{"longreach": record}`` as JSON."""
        return json.dumps({CONFIG_KEY: self.record})

    def __call__(self, hf_config):
        text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        if hasattr(text, "max_position_embeddings"):  # vLLM also calls this on configs that are not the model's
            check(self.record, int(text.max_position_embeddings))
        setattr(hf_config, CONFIG_KEY, self.record)
        return hf_config

    def __repr__(self) -> str:
        return f"longreach.integrations.vllm.Overrides({self.json})"


def overrides(method: str = "string", *, training_window: int | None = None, **params) -> Overrides:
    """vLLM's ``hf_overrides`` that run ``method`` with ``params``: ``LLM(model, hf_overrides=overrides("string"))``.

    Args:
        method: a position method vLLM runs with longreach: ``rope``, ``string``, ``rerope``, ``self_extend``, ``dca``.
        training_window: ``L``; default: the model's ``max_position_embeddings``.
        **params: the method's parameters, as for ``longreach.apply``.

    Returns:
        :class:`Overrides`, which puts the record :func:`method_of` reads on the model's config; checked now as far
        as the model is not needed (all of it with ``training_window``), and against the model when vLLM loads
        its config.

    Raises:
        ValueError: one line naming what vLLM cannot run, or the parameter, its value and what is allowed.
    """
    record = json.loads(json.dumps({"method": method, "params": params, "training_window": training_window}))
    _runs_in_vllm(record)
    if training_window is not None:
        check(record, training_window)
    return Overrides(record)


def check(record: dict, window: int) -> PositionMethod:
    """The method a record describes for a model of training window ``window``, or a one-line ``ValueError``."""
    _runs_in_vllm(record)
    params = record.get("params") or {}
    return methods.create(record["method"], training_window=int(record.get("training_window") or window), **params)


def _runs_in_vllm(record: dict) -> None:
    """A one-line ``ValueError`` unless vLLM runs what the record asks for."""
    if not isinstance(record, dict) or not isinstance(record.get("method"), str):
        raise ValueError(f"{CONFIG_KEY}={record!r} must be a record such as {{'method': 'string', 'params': {{}}}}")
    name = record["method"]
    if name not in SUPPORTED:
        kind = methods.kind_of(name)  # an unknown name: its own one-line error
        raise ValueError(
            f"method={name!r} ({kind}) does not run in vLLM with longreach yet; supported: {', '.join(SUPPORTED)}"
        )
    for composed in ("scaling", "drop"):
        if record.get(composed):
            raise ValueError(f"{composed}={record[composed]!r}: composed methods do not run in vLLM yet")
    if (record.get("params") or {}).get("mscale"):
        raise ValueError("mscale=True: a logit scale does not run in vLLM with longreach yet")


def _window(hf_config) -> int:
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    return int(text.max_position_embeddings)


def method_of(hf_config) -> PositionMethod | None:
    """The method a model's config records (``None``: the model runs as in stock vLLM)."""
    record = getattr(hf_config, CONFIG_KEY, None)
    return check(record, _window(hf_config)) if record else None


def inverse_frequencies(hf_config, head_size: int) -> torch.Tensor:
    """The rotary pairs' frequencies ``[P]`` (float32), as transformers computes them for the model (Su et al. 2021,
    Eq. 15: ``theta_k = base^(-2k / d)`` over the rotary dimensions ``d``), which vLLM's ``get_rope`` matches."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    rope = dict(getattr(text, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") != "default":
        raise ValueError(
            f"rope_type={rope['rope_type']!r}: longreach's methods run in vLLM on models with plain RoPE only, for now"
        )
    partial = rope.get("partial_rotary_factor", getattr(text, "partial_rotary_factor", 1.0))
    dims = int(head_size * partial)
    base = float(rope.get("rope_theta", getattr(text, "rope_theta", 10000.0)))
    return 1.0 / (base ** (torch.arange(0, dims, 2, dtype=torch.int64).to(torch.float32) / dims))


def register() -> None:
    """The ``vllm.general_plugins`` entry point: longreach's CPU backend in place of ``CPU_ATTN`` (cheap, idempotent,
    safe in every process)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, "longreach.integrations.vllm_cpu.LongreachCPUBackend")

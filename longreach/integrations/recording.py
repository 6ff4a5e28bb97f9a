"""What a forward pass of an applied model records or is told, through context managers: attention
dispersion (:func:`probing`), DPE's pair importance (:func:`pair_importance`) and where prompts end
(:func:`generation`, which ``generate`` of an applied model declares by itself)."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import TYPE_CHECKING, cast

import torch

if TYPE_CHECKING:
    from transformers import GenerationMixin, PreTrainedModel

probe: contextvars.ContextVar = contextvars.ContextVar("longreach_probe", default=None)


@contextlib.contextmanager
def probing(rows: torch.Tensor, top_k: int):
    """Record attention dispersion during the prefill inside this context, with whatever method is applied.

    Args:
        rows: the absolute indices of the queries to record.
        top_k: how many of each query's largest attention probabilities to sum.

    Yields:
        A dict ``{layer index: [batch, len(rows)] tensor}``, filled by the forward pass: per layer, the
        mean over heads of the ``top_k`` largest probabilities of each recorded query.
    """
    record: dict[int, torch.Tensor] = {}
    token = probe.set((rows, top_k, record))
    try:
        yield record
    finally:
        probe.reset(token)


_prompt_lengths: contextvars.ContextVar = contextvars.ContextVar("longreach_prompt_lengths", default=None)
_compiled_prompt_lengths: list = [
    None
]  # the same lengths as a plain global, which TorchDynamo can read (a context variable it cannot)


@contextlib.contextmanager
def generation(prompt_lengths: torch.Tensor):
    """Declare where each prompt ends, for a decoding loop of your own.

    Queries at positions ``>= prompt_lengths[row]`` (counting the row's real tokens) are generated
    tokens. ``model.generate`` of an applied model declares it by itself; outside both, every token is
    prompt text. Two things depend on it: Dynamic Drop Attention's ``generated_rate``, and DCA's
    ``mscale``, whose temperature then takes the whole prompt's length for every prompt token, so that
    a prompt read in chunks scores as one forward does.

    Args:
        prompt_lengths: ``[B]``, each row's prompt length. A batch ``k`` times larger (beams,
            ``num_return_sequences``) repeats each row ``k`` times, as ``generate`` does.
    """
    lengths = torch.as_tensor(prompt_lengths).reshape(-1).long()
    token, outer = _prompt_lengths.set(lengths), _compiled_prompt_lengths[0]
    _compiled_prompt_lengths[0] = lengths
    try:
        yield
    finally:
        _prompt_lengths.reset(token)
        _compiled_prompt_lengths[0] = outer


def generate(model: PreTrainedModel, previous, *args, **kwargs):
    """``model.generate`` of an applied model: transformers' own (or the one it had), inside :func:`generation`."""
    generating = cast("type[GenerationMixin]", type(model))  # a causal language model's class mixes it in
    run = previous if previous is not None else generating.generate.__get__(model)
    lengths = _prompt_lengths_of(model, args, kwargs)
    if lengths is None:
        return run(*args, **kwargs)
    with generation(lengths):
        return run(*args, **kwargs)


def _prompt_lengths_of(model: PreTrainedModel, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """Each prompt's real tokens: its attention mask's sum, else the tokens that are not padding where
    ``generate`` would infer the mask from them (``_prepare_attention_mask_for_generation``: a pad token
    in the inputs that is not also the end-of-sequence token), else every token."""
    inputs = kwargs.get("input_ids", kwargs.get("inputs", args[0] if args else None))
    inputs = kwargs.get("inputs_embeds") if inputs is None else inputs
    if not isinstance(inputs, torch.Tensor) or inputs.dim() < 2:
        return None
    if (mask := kwargs.get("attention_mask")) is not None:
        return mask.sum(-1).cpu()
    config = kwargs.get("generation_config") or model.generation_config
    pad = kwargs.get("pad_token_id", config.pad_token_id)
    eos = kwargs.get("eos_token_id", config.eos_token_id)
    if (
        pad is not None
        and inputs.dim() == 2
        and not inputs.is_floating_point()
        and bool((inputs == pad).any())
        and pad not in (eos if isinstance(eos, (list, tuple)) else [eos])
    ):
        return (inputs != pad).sum(-1).cpu()
    return torch.full((inputs.shape[0],), inputs.shape[1])


def declared_prompt(batch: int, device) -> torch.Tensor | None:
    """The declared prompt lengths ``[batch]`` for this forward (see :func:`generation`), if any."""
    lengths = _compiled_prompt_lengths[0] if torch.compiler.is_compiling() else _prompt_lengths.get()
    if lengths is None:
        return None
    if batch % lengths.shape[0]:
        raise ValueError(f"longreach.generation declared {lengths.shape[0]} prompts for a batch of {batch}")
    return lengths.repeat_interleave(batch // lengths.shape[0]).to(device)


importance: contextvars.ContextVar = contextvars.ContextVar("longreach_pair_importance", default=None)


@contextlib.contextmanager
def pair_importance() -> Iterator[dict[int, torch.Tensor]]:
    """Record, per layer, DPE's importance of each rotary pair in each query head during prefill: the mean
    over the real tokens of ``|q_p| |k_p|`` (each pair's 2-D norm, which RoPE's rotation leaves unchanged;
    a key/value head serves its group of query heads), as LuLuLuyi/DPE ``qk_2_norm_select_dim.py``.

    Yields a dict ``{layer index: [batch, query heads, pairs] tensor}`` filled by the forward pass.
    """
    record: dict[int, torch.Tensor] = {}
    token = importance.set(record)
    try:
        yield record
    finally:
        importance.reset(token)


def _pair_norms(x: torch.Tensor, pairs: int) -> torch.Tensor:
    """``[..., D]`` -> ``[..., pairs]``: the norm of each rotary pair ``(x_p, x_{p + pairs})`` in float32."""
    x = x.float()
    return torch.hypot(x[..., :pairs], x[..., pairs : 2 * pairs])


def record_importance(record: dict, layer: int, query: torch.Tensor, key: torch.Tensor, pairs: int, padding) -> None:
    q_norms = _pair_norms(query, pairs)  # [B, Hq, L, P]
    k_norms = _pair_norms(key, pairs).repeat_interleave(query.shape[1] // key.shape[1], dim=1)
    weight = torch.ones(query.shape[0], query.shape[2], device=query.device) if padding is None else padding.float()
    products = (q_norms * k_norms * weight[:, None, :, None]).sum(2)
    record[layer] = (products / weight.sum(-1)[:, None, None]).cpu()

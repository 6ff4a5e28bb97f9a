"""The self-check ``apply`` runs before it changes a model: the model's own code, at two positions, against the layout
read from its config.

Each attention layer's layout (:mod:`.families`) says how RoPE turns its queries and keys. A fine-tune with an edited
config, remote code, or a family added after this release may turn them otherwise, and every method would then move
them wrong without a sign. So ``apply`` runs the model's own forward on one token at a handful of positions, as a
batch of one-token rows (the same input in every row, through transformers' public ``AttentionInterface``, with a
function that records each layer's rotated query and key and returns its value, which is what attention over one key
is). A one-token row's attention does not depend on its position, so every layer receives the same hidden state in
every row; its query at position ``p`` must then be its query at position 0 turned by ``p`` as the layout says
(:func:`moved`): or unchanged, in a layer without RoPE. A layer that departs from its layout by more than its dtype's
rounding, a layer that never calls the interface, or one that hands the attention what longreach does not compute
(sinks, a softcap, a position bias) is refused in one line, before any weight or setting of the model changes.

It costs one forward of a few single-token rows, a decoding step's worth, and reads each layer's frequencies where
the layout says (a model whose frequencies differ from its rotary module's fails too).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any, cast

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..attention.layout import PAIRINGS, Layout

NAME = "longreach_self_check"
# What a model's attention layer may hand the attention function beyond queries, keys and values, and longreach's
# attention computes or ignores rightly; anything else changes attention (sinks, softcapping, a position bias).
UNDERSTOOD = {
    "position_ids",
    "sliding_window",
    "output_attentions",
    "output_hidden_states",
    "output_router_logits",
    "use_cache",
    "cache_position",
    "logits_to_keep",
    "return_dict",
    "is_causal",
}
# How far a layer's own rotation may be from the layout's, relative to the vector's norm: its dtype's rounding, and
# the angles' (transformers computes ``position * inv_freq`` in float32, whatever the dtype, so an angle is off by up
# to a few units of float32's last place at its size: ANGLE_ROUNDING per position). A wrong layout is off by about 1.
TOLERANCE = {torch.float64: 1e-5, torch.float32: 1e-4, torch.bfloat16: 0.05, torch.float16: 0.01}
ANGLE_ROUNDING = 2.0**-22
LAST_POSITION = 4095  # far enough for every frequency to have turned, near enough for float32 angles to hold

_recorded: contextvars.ContextVar[dict | None] = contextvars.ContextVar("longreach_self_check", default=None)


def _record(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The attention function of the self-check: records the layer's rotated query and key and what else it was
    handed, and returns attention over a single key (its value, for every query head)."""
    recorded = _recorded.get()
    if recorded is not None:
        extras = sorted(
            name
            for name, value_ in kwargs.items()
            if value_ is not None and name not in UNDERSTOOD and not (name == "is_causal" and value_)
        )
        if kwargs.get("is_causal") is False:
            extras.append("is_causal=False")
        rows = (query[:, :, -1].detach().cpu(), key[:, :, -1].detach().cpu())  # layers may sit on several devices
        recorded[getattr(module, "layer_idx", None)] = (*rows, extras)
    groups = query.shape[1] // value.shape[1]
    return value[:, :, -1:].repeat_interleave(groups, dim=1).transpose(1, 2), None


AttentionInterface.register(NAME, _record)
AttentionMaskInterface.register(NAME, sdpa_mask)


def probe_positions(window: int) -> list[int]:
    """Positions spread up to :data:`LAST_POSITION`, below ``window`` (the model's, and its
    ``original_max_position_embeddings``: no dynamic RoPE changes its frequencies while the self-check runs)."""
    last = min(window - 1, LAST_POSITION)
    return sorted({p for p in (0, 1, 2, 3, 7, 19, 61, 197, 613, 1999) if p < last} | {last})


def tolerance(dtype: torch.dtype, positions: list[int]) -> float:
    """How far a correct layer's rows may depart from the layout's turn at ``positions``, relative to their norm."""
    return TOLERANCE.get(dtype, 0.05) + max(positions) * ANGLE_ROUNDING


def check(model: nn.Module, layouts: dict[int, Layout], frequencies, family: str, window: int) -> None:
    """Raise ``ValueError`` (one line) unless every attention layer of ``model`` turns its queries and keys as
    ``layouts`` says, with the frequencies ``frequencies(layout)`` returns (a tensor ``[R/2]``), at positions below
    ``window``. ``family`` names the model in the error."""
    positions = probe_positions(window)
    recorded = _run(model, positions)
    missing = sorted(set(layouts) - set(recorded))
    if missing:
        raise ValueError(
            f"{family}: attention layer {missing[0]} never called transformers' attention interface in the "
            "self-check; longreach cannot change what it does not see"
        )
    extra = sorted(layer for layer in recorded if layer not in layouts)
    if extra:
        raise ValueError(
            f"{family}: layer {extra[0]} calls the attention interface but its config does not say it is an "
            "attention layer; longreach refuses a model whose layers it cannot state"
        )
    for layer, layout in sorted(layouts.items()):
        query, key, extras = recorded[layer]
        if extras:
            raise ValueError(
                f"{family}: layer {layer} hands its attention {', '.join(extras)}, which longreach's attention does "
                "not compute"
            )
        if query.shape[-1] != layout.head_dim or key.shape[-1] != layout.head_dim:
            raise ValueError(
                f"{family}: layer {layer}'s queries have {query.shape[-1]} dimensions, its layout {layout.head_dim}"
            )
    delta = torch.tensor(positions, dtype=torch.float64)
    alike: dict[Layout, list[int]] = {}  # the layers of one layout turn by the same frequencies: checked at once
    for layer, layout in sorted(layouts.items()):
        alike.setdefault(layout, []).append(layer)
    for layout, layers in alike.items():
        queries, keys = (torch.stack([recorded[layer][part] for layer in layers]) for part in (0, 1))
        inv_freq = frequencies(layout) if layout.rotated else None
        errors = _departures(queries, keys, delta, layout, inv_freq)
        allowed = tolerance(queries.dtype, positions)
        if bool((errors > allowed).any()):
            worst = int((errors > allowed).nonzero()[0])
            found = _what_it_does(queries[worst : worst + 1], keys[worst : worst + 1], delta, layout, inv_freq, allowed)
            raise ValueError(
                f"{family}: the self-check refuses layer {layers[worst]}: its own rotary code departs from the layout "
                f"read from its config ({layout.describe()}) by {float(errors[worst]):.2g} of the vectors' norm"
                f"{f'; it behaves as {found}' if found else ''}; longreach refuses a model whose rotation it cannot "
                "state"
            )


def _run(model: nn.Module, positions: list[int]) -> dict:
    """Each attention layer's rotated query and key ``[P, H, D]`` for one token at each of ``positions``."""
    weight = cast(Any, model).get_input_embeddings().weight  # a transformers model's
    token = int(weight[:512].float().norm(dim=-1).argmax())  # not a padding token, whose embedding may be zeros
    device = weight.device
    recorded: dict = {}
    base = getattr(model, "base_model", model)  # the decoder alone: the language model head reads nothing here
    with _recording(recorded), _evaluating(model), _implementation(model, NAME), torch.no_grad():
        base(
            input_ids=torch.full((len(positions), 1), token, device=device),
            position_ids=torch.tensor(positions, device=device)[:, None],
            attention_mask=torch.ones(len(positions), 1, dtype=torch.long, device=device),
            use_cache=False,
        )
    return recorded


def moved(x: torch.Tensor, delta: torch.Tensor, layout: Layout, inv_freq: torch.Tensor) -> torch.Tensor:
    """``x [..., P, H, D]`` (float64) turned by ``delta [P]`` positions as ``layout`` pairs its dimensions."""
    a, b = layout.pair_indices()
    angle = delta[:, None, None] * inv_freq.to(torch.float64)
    cos, sin = angle.cos(), angle.sin()
    out = x.clone()
    out[..., a] = x[..., a] * cos - x[..., b] * sin
    out[..., b] = x[..., b] * cos + x[..., a] * sin
    return out


def _departures(queries, keys, delta, layout: Layout, inv_freq) -> torch.Tensor:
    """For each layer of ``queries`` and ``keys [layers, P, H, D]``, how far its rows at each position are from its
    row at the first (position 0) moved there, relative to their norm: the largest, ``[layers]``."""
    worst = torch.zeros(queries.shape[0], dtype=torch.float64)
    for rows in (queries, keys):
        rows = rows.to(torch.float64).cpu()
        expected = rows[:, :1].expand_as(rows)
        if layout.rotated:
            expected = moved(expected, delta - delta[0], layout, inv_freq.cpu())
        error = (expected - rows).norm(dim=-1) / rows.norm(dim=-1).clamp(min=1e-30)
        worst = torch.maximum(worst, error.flatten(1).amax(1))
    return worst


def _what_it_does(query, key, delta, layout: Layout, inv_freq, allowed: float) -> str | None:
    """The layout one layer's rows (``[1, P, H, D]``) do follow, among the other pairings, places and no RoPE, for
    the error."""
    candidates = [Layout(False, layout.head_dim)]
    if inv_freq is not None:
        dims = layout.dims
        for pairs in PAIRINGS:
            for start in sorted({0, layout.head_dim - dims}):
                candidates.append(Layout(True, layout.head_dim, pairs, start, dims, layout.layer_type))
    for candidate in candidates:
        if candidate != layout and float(_departures(query, key, delta, candidate, inv_freq)[0]) <= allowed:
            return candidate.describe()
    return None


@contextlib.contextmanager
def _recording(recorded: dict) -> Iterator[None]:
    token = _recorded.set(recorded)
    try:
        yield
    finally:
        _recorded.reset(token)


@contextlib.contextmanager
def _evaluating(model: nn.Module) -> Iterator[None]:
    """Every module in eval mode (no dropout) while the self-check runs, as it was after."""
    training = {module: module.training for module in model.modules()}
    model.eval()
    try:
        yield
    finally:
        for module, mode in training.items():
            module.training = mode


@contextlib.contextmanager
def _implementation(model, name: str) -> Iterator[None]:
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)

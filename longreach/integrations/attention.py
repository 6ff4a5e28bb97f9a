"""The attention function registered with transformers' ``AttentionInterface``: it reads the method applied
to a layer from the module (``module._longreach``, set by :func:`longreach.apply`) and runs the kernel
(:mod:`longreach.attention.kernel`), the compiled decoding step (:mod:`longreach.attention.compiled_step`) or the
dense reference, with one :class:`~longreach.attention.memo.Memo` per forward pass shared by its layers."""

from __future__ import annotations

import functools
import math
import warnings

import torch

from ..attention import compiled_step, kernel, reference, whole_rows
from ..attention.layout import to_kernel
from ..attention.plan import SMALL_QUERY
from . import recording
from .positions import keys_of

_warned_attentions = False


def attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The function registered with ``AttentionInterface`` under ``longreach``: reads what is applied from
    ``module``."""
    state = _state_of(module, dropout, kwargs)
    batch, q_len = query.shape[0], query.shape[2]
    if query.device.type == "meta":
        return query.new_empty(batch, q_len, query.shape[1], value.shape[-1]), None
    layer = getattr(module, "layer_idx", None)
    layer_state = state.layer(layer)
    if torch.compiler.is_compiling() and q_len <= SMALL_QUERY and state.backend != "reference":
        return _compiled_step(
            state, layer_state, module, query, key, value, attention_mask, scaling, kwargs.get("sliding_window")
        ), None
    kept_keys = state.kept_keys_of(layer) if layer_state.layout.rotated else None
    if kept_keys is not None:
        kept_keys.begin(key, q_len)  # the key tensor the cache handed over, before it is cut to the real keys
    position_ids = kwargs.get("position_ids")
    shapes = (batch, q_len, key.shape[2], str(query.device))
    memo, keys = state.passes.find(
        attention_mask,
        position_ids,
        shapes,
        lambda: keys_of(attention_mask, key.shape[2], position_ids, batch, query.device),
    )
    key, value = key[:, :, : keys.count], value[:, :, : keys.count]
    layout, inv_freq = layer_state.layout, layer_state.frequencies()
    logit_scale, rates = _logit_scale_and_rates(state, layer_state, keys.positions, keys.positions[:, -q_len:], memo)
    sliding_window = kwargs.get("sliding_window")
    raw_query, raw_key = query, key
    query, key = to_kernel(layout, query, key)  # a layout the kernels do not read as it is: permuted into theirs
    if state.backend == "reference":
        out = _reference(
            layer_state, raw_query, raw_key, value, inv_freq, scaling, keys, sliding_window, logit_scale, rates
        )
    else:
        out = kernel.attention(
            query,
            key,
            value,
            layer_state.parts(),
            inv_freq,
            scaling=scaling,
            key_padding=keys.padding,
            sliding_window=sliding_window,
            logit_scale=logit_scale,
            positions=keys.positions,
            drop=rates,
            backend=state.backend,
            memo=memo,
            kept_keys=kept_keys,
        )
    if (importance := recording.importance.get()) is not None and q_len == keys.count:
        if layout.rotated:
            recording.record_importance(importance, module.layer_idx, query, key, inv_freq.shape[-1], keys.padding)
        else:  # a layer without RoPE: no rotary pair matters to it
            importance[module.layer_idx] = torch.zeros(batch, query.shape[1], inv_freq.shape[-1])
    if (probe := recording.probe.get()) is not None and q_len == keys.count:
        _record(probe, layer_state, module, query, key, inv_freq, scaling, keys, sliding_window, logit_scale, rates)
    return out.contiguous(), None  # a view of the kernel's [B, Hq, Lq, D]: some models .view() it


def _state_of(module, dropout: float, kwargs: dict):
    """What :func:`longreach.apply` set on ``module``; refuses what the attention does not support (dropout, logit
    softcapping) and warns once that it returns no attention weights."""
    global _warned_attentions
    state = module.__dict__.get("_longreach")
    if state is None:
        raise ValueError(
            f"{module.__class__.__name__} has attn_implementation='longreach' but no method: "
            "use longreach.apply(model, ...)"
        )
    if dropout:
        raise ValueError(
            f"longreach attention does not support attention dropout (got dropout={dropout}); "
            "set the config's attention_dropout=0"
        )
    if kwargs.get("softcap") is not None:
        raise ValueError("longreach attention does not support attention logit softcapping (Gemma 2)")
    if kwargs.get("output_attentions") and not _warned_attentions:
        warnings.warn(
            "longreach attention does not return attention weights (output_attentions=True gives None); "
            "use longreach.integrations.recording.probing or the dense reference backend",
            stacklevel=3,  # attention_forward's caller
        )
        _warned_attentions = True
    return state


def _compiled_step(
    state, layer_state, module, query, key, value, attention_mask, scaling, sliding_window
) -> torch.Tensor:
    """A decoding step (a few queries) under ``torch.compile``: every cache slot scored on the device, no host
    sync and no data-dependent shape (:mod:`longreach.attention.compiled_step`), so the step compiles with
    ``fullgraph=True`` and can be captured in a CUDA graph."""
    kv_len = key.shape[2]
    if attention_mask is None:
        positions = torch.arange(kv_len, device=query.device).expand(query.shape[0], -1)
    else:
        positions = attention_mask[:, 0, 0, :].to(query.device)
    query_positions = compiled_step.query_positions(positions, query.shape[2])
    logit_scale, rates = _logit_scale_and_rates(state, layer_state, positions, query_positions)
    query, key = to_kernel(layer_state.layout, query, key)
    return compiled_step.attention(
        query,
        key,
        value,
        layer_state.parts(),
        layer_state.frequencies(),
        positions,
        scaling=scaling,
        sliding_window=sliding_window,
        logit_scale=logit_scale,
        drop=rates,
        backend=state.backend,
    )


def _logit_scale_and_rates(
    state, layer_state, positions: torch.Tensor, query_positions: torch.Tensor, memo=None
) -> tuple[float | torch.Tensor, torch.Tensor | None]:
    """The method's logit factor for the sequences so far (``positions [B, Lkv]``, the keys': the longest one
    plus one; a prompt declared to :func:`.recording.generation` counts whole, however it is read) and, in a
    layer that drops, the drop rate of each query ``[B, Lq]`` at ``query_positions`` (else None), the same for
    every such layer of the pass: built once per pass with the pass's ``memo`` (none under ``torch.compile``).
    A layer without RoPE is stock: no factor, no drop."""
    if not layer_state.layout.rotated:
        return 1.0, None
    prompt = recording.declared_prompt(positions.shape[0], positions.device)
    tokens = positions.amax(-1) + 1  # right padding: its last real token
    logit_scale = state.method.logit_scale_at(tokens if prompt is None else torch.maximum(tokens, prompt))
    if state.drop is None or layer_state.index not in state.drop.layers:
        return logit_scale, None
    generated = None if prompt is None else query_positions >= prompt[:, None]
    rates = functools.partial(state.drop.rates, query_positions, state.window, generated)
    if memo is None:
        return logit_scale, rates()
    return logit_scale, memo.get("drop rates", (state.drop,), (state.window, query_positions.shape[-1]), rates)


def _record(
    probe, layer_state, module, query, key, inv_freq, scaling, keys, sliding_window, logit_scale, rates
) -> None:
    sampled, top_k, record = probe
    sampled = sampled[sampled < query.shape[2]].to(query.device)
    tops = [
        probabilities.topk(min(top_k, probabilities.shape[-1]), dim=-1).values.mean(-1).mean(1)  # [B, T]
        for probabilities, _ in whole_rows.attention_probabilities(
            query[:, :, sampled],
            key,
            layer_state.parts(),
            inv_freq,
            sampled,
            scaling,
            keys.padding,
            sliding_window,
            logit_scale,
            keys.positions,
            None if rates is None else rates[:, sampled],
        )
    ]
    record[module.layer_idx] = torch.cat(tops, dim=-1).float().cpu()


def _reference(layer_state, query, key, value, inv_freq, scaling, keys, sliding_window, logit_scale, rates):
    """Undo RoPE where it was applied, then the dense per-pair oracle at the method's positions (float64, O(n^2)),
    the pairs where the layer's layout says they are."""
    q_len, layout = query.shape[2], layer_state.layout
    attention_scaling = layer_state.attention_scaling()
    q_raw = reference.unrotate(query, keys.rotated_at[:, -q_len:], inv_freq, attention_scaling, layout)
    k_raw = reference.unrotate(key, keys.rotated_at, inv_freq, attention_scaling, layout)
    q_pos, k_pos = keys.positions[:, -q_len:, None], keys.positions[:, None, :]
    P = layer_state.method.layer_positions(q_pos, k_pos, layer_state.index)
    if sliding_window is not None:
        inside = q_pos - k_pos < sliding_window
        P = torch.where(inside if P.dim() == 3 else inside[:, None, :, :, None], P, torch.nan)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scaling is None else scaling
    out = reference.dense_attention(
        q_raw, k_raw, value, P, inv_freq, scale, attention_scaling, keys.padding, logit_scale, rates, layout=layout
    )
    return out.to(query.dtype)

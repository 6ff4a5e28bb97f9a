"""Property-based checks (hypothesis): random methods and parameters, lengths, left pads, GQA ratios,
families, dtypes and cache kinds, each against the float64 dense reference."""

import pytest
import torch
from helpers.cases import case
from helpers.tiny_models import tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import DynamicCache, StaticCache

import longreach
from longreach.attention import kernel, reference
from longreach.methods import create

pytestmark = pytest.mark.slow  # 30 examples of each: about a minute

SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


@st.composite
def methods(draw, window):
    """A valid position method for training window ``window``, with random parameters."""
    name = draw(st.sampled_from(["rope", "string", "rerope", "self_extend", "dca"]))
    if name == "string":
        shift = draw(st.integers(2, window - 1))
        return name, {"shift": shift, "local_window": draw(st.integers(1, shift - 1)), "mscale": draw(st.booleans())}
    if name == "rerope":
        return name, {"window": draw(st.integers(1, window)), "leak": draw(st.one_of(st.none(), st.floats(1.5, 4.0)))}
    if name == "self_extend":
        return name, {"group_size": draw(st.integers(1, 5)), "neighbor_window": draw(st.integers(1, window))}
    if name == "dca":
        chunk = draw(st.integers(3, window))
        return name, {
            "chunk_size": chunk,
            "local_window": draw(st.integers(1, chunk - 1)),
            "mscale": draw(st.booleans()),
        }
    return name, {}


@SETTINGS
@given(
    data=st.data(),
    n=st.integers(8, 100),
    pad=st.integers(0, 30),
    q_len=st.sampled_from([None, 1, 7]),
    kv_heads=st.sampled_from([1, 2, 4]),
    dtype=st.sampled_from([torch.float64, torch.float32, torch.bfloat16]),
    rotary=st.sampled_from([16, 8]),
    drop=st.booleans(),
    backend=st.sampled_from(["auto", "flex"]),
)
def test_the_kernel_equals_the_reference_on_random_cases(data, n, pad, q_len, kv_heads, dtype, rotary, drop, backend):
    window = data.draw(st.integers(8, 64), label="window")
    name, params = data.draw(methods(window), label="method")
    method = create(name, training_window=window, **params)
    pads = (0, min(pad, n - 1))
    q, k, v, q_rot, k_rot, positions, padding, inv_freq = case(
        n, q_heads=4, kv_heads=kv_heads, rotary_dims=rotary, pads=pads
    )
    q_len = q_len or n
    scale = method.logit_scale_at(positions[:, -1] + 1)
    rates = (
        torch.rand(2, q_len, generator=torch.Generator().manual_seed(n), dtype=torch.float64) * 0.5 if drop else None
    )
    P = method.relative_positions(positions[:, -q_len:, None], positions[:, None, :])
    want = reference.dense_attention(
        q[:, :, -q_len:], k, v, P, inv_freq, 0.3, key_padding=padding, logit_scale=scale, drop_rates=rates
    )
    got = kernel.attention(
        q_rot[:, :, -q_len:].to(dtype),
        k_rot.to(dtype),
        v.to(dtype),
        method.parts(),
        inv_freq.to(dtype),
        scaling=0.3,
        key_padding=padding if pads[1] else None,
        positions=positions,
        logit_scale=scale,
        drop=rates,
        tile=16,
        backend=backend,
    )
    tolerance = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 0.1}[dtype]
    if drop and dtype != torch.float64:
        return  # low precision may move a score across the quantile: drops are compared in float64 only
    assert (got.double() - want)[padding[:, -q_len:]].abs().max() <= tolerance


FAMILIES = {"llama": {}, "qwen2": {}, "mistral": {"sliding_window": 20}, "gemma3": {}, "phi3": {}}


@SETTINGS
@given(
    data=st.data(),
    family=st.sampled_from(sorted(FAMILIES)),
    n=st.integers(12, 110),
    pad=st.integers(0, 25),
    cache=st.sampled_from(["none", "dynamic", "static"]),
    kv_heads=st.sampled_from([1, 2, 4]),
)
@torch.no_grad()
def test_models_equal_the_reference_with_every_cache_kind(data, family, n, pad, cache, kv_heads):
    window = data.draw(st.integers(16, 96), label="window")
    name, params = data.draw(methods(window), label="method")
    extra = {} if family == "phi3" else {"num_key_value_heads": kv_heads}
    model = tiny_model(family, dtype=torch.float64, **FAMILIES[family], **extra)
    x = torch.randint(3, 97, (2, n), generator=torch.Generator().manual_seed(n))
    mask = torch.ones_like(x)
    mask[1, : min(pad, n - 2)] = 0
    longreach.apply(model, name, training_window=window, backend="reference", **params)
    want = model(x, attention_mask=mask).logits
    longreach.apply(model, name, training_window=window, **params)
    if cache == "none":
        got = model(x, attention_mask=mask).logits
    else:  # a chunked prefill into the cache, then one-token steps
        split = data.draw(st.integers(1, n - 1), label="split")
        past = (
            DynamicCache(config=model.config)
            if cache == "dynamic"
            else StaticCache(config=model.config, max_cache_len=n + 3)
        )
        pieces = [model(x[:, :split], attention_mask=mask[:, :split], past_key_values=past).logits]
        for end in range(split + 1, n + 1):
            pieces.append(model(x[:, end - 1 : end], attention_mask=mask[:, :end], past_key_values=past).logits)
        got = torch.cat(pieces, dim=1)
        if params.get("mscale") and name == "dca" and n > window:
            return  # DCA's temperature depends on the current length: cached states differ by design
    assert (got - want)[mask.bool()].abs().max() <= 1e-8

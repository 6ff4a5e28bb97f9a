"""``keep_moved_keys=True`` gives, bit for bit, what moving every key gives, whatever happens to the cache between
calls: another conversation, a speculative crop and re-draft, a beam reorder, interleaved conversations, a reset
static cache, a deep copy. Each scenario ends its rewritten sequences on the same token as before, the case the
last-key check of earlier versions let through (at layer 0 a key depends on its token and position only)."""

import copy

import pytest
import torch
import transformers
from helpers.tiny_models import tiny_model

import longreach
from longreach.integrations import kept_keys

METHODS = {
    "rerope": dict(window=30, leak=2.0),
    "self_extend": dict(group_size=3, neighbor_window=16),
    "dca": dict(chunk_size=30, local_window=6),
}


def tokens(n, seed, batch=1):
    return torch.randint(3, 97, (batch, n), generator=torch.Generator().manual_seed(seed))


def forward(model, x, cache):
    return model(x, past_key_values=cache, use_cache=True).logits


def two_conversations(model):
    """One conversation, then another on a new cache whose last prompt token is the first's."""
    first, second = tokens(40, 1), tokens(40, 2)
    second[:, -1] = first[:, -1]
    logits = [forward(model, first, transformers.DynamicCache(config=model.config))]
    logits.append(forward(model, second, transformers.DynamicCache(config=model.config)))
    return logits


def speculative(model):
    """A draft of 36 tokens, cropped to 2 and re-drafted with 34 others that end on the same last token (long enough
    for the re-drafted queries to reach the rewritten keys through the far part)."""
    cache = transformers.DynamicCache(config=model.config)
    x = tokens(40, 3)
    logits = [forward(model, x, cache)]
    draft = tokens(36, 4)
    logits.append(forward(model, draft, cache))
    cache.crop(-34)  # the cache ends at 42 tokens
    redraft = tokens(34, 5)
    redraft[:, -1] = draft[:, -1]
    logits.append(forward(model, redraft, cache))
    logits.append(forward(model, tokens(1, 6), cache))
    return logits


def beam_reorder(model):
    """Two rows ending on the same token, swapped between steps as a beam search does."""
    x = tokens(40, 7, batch=2)
    x[1, -1] = x[0, -1]
    cache = transformers.DynamicCache(config=model.config)
    logits = [forward(model, x, cache)]
    cache.reorder_cache(torch.tensor([1, 0]))
    logits.append(forward(model, tokens(1, 8, batch=2), cache))
    return logits


def interleaved(model):
    """Two conversations of equal lengths, a step of each in turn."""
    first, second = tokens(40, 9), tokens(40, 10)
    second[:, -1] = first[:, -1]
    caches = [transformers.DynamicCache(config=model.config) for _ in range(2)]
    logits = [forward(model, first, caches[0]), forward(model, second, caches[1])]
    for step in range(3):
        for cache in caches:
            logits.append(forward(model, tokens(1, 11 + step), cache))
    return logits


def static_reset(model):
    """A static cache used, reset, and used again for another prompt ending on the same token."""
    cache = transformers.StaticCache(config=model.config, max_cache_len=64)
    first, second = tokens(40, 12), tokens(40, 13)
    second[:, -1] = first[:, -1]
    logits = [forward(model, first, cache), forward(model, tokens(1, 14), cache)]
    cache.reset()
    logits += [forward(model, second, cache), forward(model, tokens(1, 14), cache)]
    return logits


def deep_copied(model):
    """A conversation, then a deep copy of the model that goes on with a copy of its cache and another token."""
    cache = transformers.DynamicCache(config=model.config)
    logits = [forward(model, tokens(40, 15), cache)]
    twin, twin_cache = copy.deepcopy(model), copy.deepcopy(cache)
    logits.append(forward(twin, tokens(1, 16), twin_cache))
    logits.append(forward(model, tokens(1, 17), cache))
    return logits


SCENARIOS = [two_conversations, speculative, beam_reorder, interleaved, static_reset, deep_copied]


@pytest.mark.parametrize("name", sorted(METHODS))
@torch.no_grad()
def test_kept_keys_give_what_moving_every_key_gives_bit_for_bit(name):
    model = tiny_model("llama")
    for scenario in SCENARIOS:
        longreach.apply(model, name, **METHODS[name])
        want = scenario(model)
        longreach.apply(model, name, keep_moved_keys=True, **METHODS[name])
        got = scenario(model)
        for step, (a, b) in enumerate(zip(got, want, strict=True)):
            assert torch.equal(a, b), f"{scenario.__name__}, call {step}: {(a - b).abs().max():.2e}"


@torch.no_grad()
def test_an_appended_cache_is_vouched_for_and_nothing_else():
    """The hook trusts a layer's kept keys only while the cache holds the very tensor the layer last received,
    unchanged."""
    model = tiny_model("llama")
    longreach.apply(model, "rerope", keep_moved_keys=True, **METHODS["rerope"])
    held = model._longreach.kept_keys_of(0)
    cache = transformers.DynamicCache(config=model.config)
    forward(model, tokens(40, 1), cache)
    held.vouch(kept_keys.cached_keys(cache, 0))
    assert held.vouched
    held.vouch(kept_keys.cached_keys(cache, 1))  # another layer's tensor
    assert not held.vouched
    cache.layers[0].keys.mul_(1.0)  # rewritten in place: the same tensor, a new version
    held.vouch(kept_keys.cached_keys(cache, 0))
    assert not held.vouched
    forward(model, tokens(1, 2), cache)
    cache.crop(-10)
    held.vouch(kept_keys.cached_keys(cache, 0))
    assert not held.vouched
    held.vouch(None)  # a forward without a cache
    assert not held.vouched
    longreach.remove(model)
    assert not any(kept_keys.HOOK in module.__dict__ for module in model.modules())

"""The CPU kernel over a paged cache (longreach.attention.paged, vLLM's layout) against the float64 dense reference:
requests of different lengths in one call, prefill, chunks, prefix hits and decoding together, blocks in any order."""

import pytest
import torch
from helpers.cases import inv_freq_for
from helpers.paged import METHODS, REQUESTS, expected, paged_case

from longreach.attention import reference
from longreach.attention.backends import cpu_fused
from longreach.attention.cells import lower
from longreach.attention.paged import (
    KeyAngles,
    attend,
    attend_by_request,
    paged_attention,
    step_layout,
    token_positions,
)
from longreach.methods import create

pytestmark = pytest.mark.skipif(not cpu_fused.available("cpu"), reason="needs a C++ compiler")


@pytest.fixture(scope="module")
def references():
    """``reference_of(name, params, block_size)``: the float64 reference of the mixed batch (:func:`paged_case` at that
    block size, float32) under a method of METHODS, computed once for the module: the layouts a test varies (a plain or
    transposed cache, the tiled path) all compare with the same one."""
    computed = {}

    def reference_of(name, params, block_size):
        key = (name, repr(params), block_size)
        if key not in computed:
            raw, *_, inv_freq = paged_case(block_size, torch.float32)
            computed[key] = expected(create(name, training_window=600, **params), raw, inv_freq, 0.3)
        return computed[key]

    return reference_of


@pytest.mark.parametrize("name, params", METHODS)
@pytest.mark.parametrize("keys", ["plain", "transposed"])
def test_every_method_matches_the_reference_for_a_mixed_batch(name, params, keys, references):
    """Block size 128 (vLLM's CPU default), GQA 4:2, six requests of every kind in one call; moved keys turned by the
    kernel as it reads them; the key cache plain or transposed (vLLM's "vec" layout)."""
    method = create(name, training_window=600, **params)
    raw, query, key_cache, value_cache, block_table, query_start, seq_lens, inv_freq = paged_case(128, torch.float32)
    cells = lower(method.parts(), None)
    angles = KeyAngles(inv_freq.float())
    transposed = keys == "transposed"
    if transposed:
        key_cache = key_cache.transpose(2, 3).contiguous()
    got = paged_attention(
        query, key_cache, value_cache, block_table, query_start, seq_lens, cells, inv_freq.float(), 0.3, angles,
        transposed,
    )  # fmt: skip
    assert got.shape == query.shape and got.dtype == torch.float32
    assert (got - references(name, params, 128)).abs().max() <= 2e-5


@pytest.mark.slow
def test_one_step_layout_serves_every_layer():
    """A step's layout holds nothing of a layer: two layers' caches and queries through one layout (as vLLM's layers
    share a step's metadata) give what each gives alone, and its moved queries and key spans are exercised (DCA)."""
    method = create("dca", training_window=600, chunk_size=200, local_window=20)
    cells = lower(method.parts(), None)
    raw, query, key_cache, value_cache, block_table, query_start, seq_lens, inv_freq = paged_case(128, torch.float32)
    second = [(q * 0.5, k * 2, -v) for q, k, v in raw]  # another layer: rotation is linear, so its cache is scaled
    layers = [(raw, query, key_cache, value_cache), (second, query * 0.5, key_cache * 2, -value_cache)]
    angles = KeyAngles(inv_freq.float())
    step = step_layout(block_table, query_start, seq_lens, int(query_start[-1]), cells, inv_freq.float(), angles)
    for raw, query, key_cache, value_cache in layers:
        got = attend(query, key_cache, value_cache, step, 0.3)
        assert (got - expected(method, raw, inv_freq, 0.3)).abs().max() <= 2e-5


@pytest.mark.slow
@pytest.mark.parametrize("block_size, dtype, tolerance", [(16, torch.float32, 2e-5), (32, torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("transposed", [False, True])
def test_small_blocks_and_a_bfloat16_cache(block_size, dtype, tolerance, transposed):
    """Blocks narrower than the kernel's key tiles and edges; a cache in bfloat16 read as float32; plain or
    transposed keys."""
    method = create("dca", training_window=600, chunk_size=200, local_window=20)
    raw, query, key_cache, value_cache, block_table, query_start, seq_lens, inv_freq = paged_case(block_size, dtype)
    if transposed:
        key_cache = key_cache.transpose(2, 3).contiguous()
    got = paged_attention(
        query, key_cache, value_cache, block_table, query_start, seq_lens, lower(method.parts(), None),
        inv_freq.float(), 0.3, KeyAngles(inv_freq.float()), transposed,
    )  # fmt: skip
    assert (got - expected(method, raw, inv_freq, 0.3)).abs().max() <= tolerance


@pytest.mark.slow
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("transposed", [False, True])
def test_turned_keys_keep_the_dimensions_past_the_rotary_pairs(dtype, tolerance, transposed):
    """Partial rotary (8 of 16 dimensions turn): a key turned as it is read keeps its other 8 as they are."""
    method = create("self_extend", training_window=600, group_size=3, neighbor_window=40)
    raw, query, key_cache, value_cache, block_table, query_start, seq_lens, inv_freq = paged_case(
        128, dtype, rotary_dims=8
    )
    if transposed:
        key_cache = key_cache.transpose(2, 3).contiguous()
    got = paged_attention(
        query, key_cache, value_cache, block_table, query_start, seq_lens, lower(method.parts(), None),
        inv_freq.float(), 0.3, KeyAngles(inv_freq.float()), transposed,
    )  # fmt: skip
    assert (got - expected(method, raw, inv_freq, 0.3)).abs().max() <= tolerance


def test_a_sliding_window_cuts_every_part():
    """The model's sliding window of 100 keys under STRING (S = 300): only the near band's rows under 100 remain (by the
    kernel, and by the tiled path request by request)."""
    method = create("string", training_window=600, shift=300, local_window=30)
    raw, query, key_cache, value_cache, block_table, query_start, seq_lens, inv_freq = paged_case(128, torch.float32)
    got = paged_attention(
        query, key_cache, value_cache, block_table, query_start, seq_lens, lower(method.parts(), 100),
        inv_freq.float(), 0.3, KeyAngles(inv_freq.float()),
    )  # fmt: skip
    windowed = create("rope", training_window=600)
    want = []
    for (q, k, v), (n, q_len) in zip(raw, REQUESTS, strict=True):
        positions = torch.arange(n)
        distance = positions[-q_len:, None] - positions[None, :]
        P = windowed.layer_positions(positions[-q_len:, None], positions[None, :], 0)
        P = torch.where(distance < 100, P, torch.nan)[None]
        want.append(reference.dense_attention(q[None, :, -q_len:], k[None], v[None], P, inv_freq, 0.3)[0])
    assert (got - torch.cat(want)).abs().max() <= 2e-5
    by_request = attend_by_request(
        query, key_cache, value_cache, block_table, query_start, seq_lens, method.parts(), inv_freq.float(), 0.3, 100
    )
    assert (by_request - torch.cat(want)).abs().max() <= 2e-5


@pytest.mark.slow
@pytest.mark.parametrize("name, params", [METHODS[1], METHODS[4], METHODS[6], METHODS[7]])
@pytest.mark.parametrize("transposed", [False, True])
def test_the_tiled_path_by_request_matches_the_reference(name, params, transposed, references):
    """Where the C++ kernel is not built (a vLLM worker never builds it): each request's keys gathered from the shuffled
    blocks of a cache (16 slots a block, plain or transposed), its rows by the tiled kernel, against the reference."""
    method = create(name, training_window=600, **params)
    raw, query, key_cache, value_cache, block_table, query_start, seq_lens, inv_freq = paged_case(16, torch.float32)
    if transposed:
        key_cache = key_cache.transpose(2, 3).contiguous()
    got = attend_by_request(
        query, key_cache, value_cache, block_table, query_start, seq_lens, method.parts(), inv_freq.float(), 0.3,
        keys_transposed=transposed,
    )  # fmt: skip
    assert got.shape == query.shape and got.dtype == torch.float32
    assert (got - references(name, params, 16)).abs().max() <= 2e-5


def test_token_positions_are_the_last_of_each_request():
    assert token_positions(torch.tensor([0, 3, 4, 6]), torch.tensor([3, 10, 5]), 6).tolist() == [0, 1, 2, 9, 3, 4]


def test_key_angles_grow_and_keep_their_rows():
    angles = KeyAngles(inv_freq_for(8).float())
    shift = next(p.key_shift for p in create("rerope", training_window=600, window=50).parts() if callable(p.key_shift))
    small = angles.of(shift, 100)[0].clone()
    large = angles.of(shift, 1000)[0]
    assert small.shape[0] == 128 and large.shape[0] == 1024 and torch.equal(large[:128], small)
    transposed = angles.of(shift, 1000, transposed=True)[0]
    assert transposed.is_contiguous() and torch.equal(transposed, large.T)

"""The CPU kernel over a paged cache (longreach.attention.paged, vLLM's layout) against the float64 dense reference:
requests of different lengths in one call, prefill, chunks, prefix hits and decoding together, blocks in any order."""

import pytest
import torch
from test_kernel import inv_freq_for

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
from longreach.attention.rotary import rotate
from longreach.methods import create

pytestmark = pytest.mark.skipif(not cpu_fused.available("cpu"), reason="needs a C++ compiler")

METHODS = [
    ("rope", {}),
    ("string", {"shift": 300, "local_window": 30}),
    ("rerope", {"window": 50}),
    ("rerope", {"window": 50, "leak": 4.0}),
    ("self_extend", {"group_size": 3, "neighbor_window": 40}),
    ("dca", {"chunk_size": 200, "local_window": 20}),
    ("dca", {"chunk_size": 90, "local_window": 7}),
    ("dpe", {"group_scales": (2, 3, 1, 4), "local_window": 40, "top_k": None}),
]

# (keys, queries) per request: a prefill over several blocks and key tiles, a chunk, a prefix hit, decoding steps
REQUESTS = [(700, 700), (1300, 37), (520, 1), (90, 90), (1100, 1), (33, 5)]


def paged_case(block_size, dtype, q_heads=4, kv_heads=2, dim=16, rotary_dims=16, seed=0):
    """Raw q/k/v per request, the rotated queries concatenated, and a cache whose blocks are shuffled."""
    g = torch.Generator().manual_seed(seed)
    inv_freq = inv_freq_for(rotary_dims)
    raw, rotated_queries, tables = [], [], []
    blocks_needed = [-(-n // block_size) for n, _ in REQUESTS]
    order = torch.randperm(sum(blocks_needed) + 3, generator=g)  # 3 blocks no request owns
    cache = torch.randn(len(order), 2, kv_heads, block_size, dim, generator=g, dtype=torch.float64)
    used = 0
    for (n, q_len), count in zip(REQUESTS, blocks_needed):
        q, k, v = (torch.randn(h, n, dim, generator=g, dtype=torch.float64) for h in (q_heads, kv_heads, kv_heads))
        positions = torch.arange(n, dtype=torch.float64)
        k_rot = rotate(k[None], positions[None, None], inv_freq)[0]
        rotated_queries.append(rotate(q[None], positions[None, None], inv_freq)[0, :, -q_len:].transpose(0, 1))
        blocks = order[used : used + count]
        used += count
        for index, block in enumerate(blocks.tolist()):  # the tail of the last block keeps its noise
            keys = slice(index * block_size, min(n, (index + 1) * block_size))
            width = keys.stop - keys.start
            cache[block, 0, :, :width] = k_rot[:, keys]
            cache[block, 1, :, :width] = v[:, keys]
        tables.append(blocks)
        raw.append((q, k, v))
    block_table = torch.zeros(len(REQUESTS), max(blocks_needed), dtype=torch.int32)
    for row, blocks in enumerate(tables):
        block_table[row, : len(blocks)] = blocks
    query_start = torch.tensor([0, *torch.tensor([q for _, q in REQUESTS]).cumsum(0).tolist()])
    seq_lens = torch.tensor([n for n, _ in REQUESTS])
    key_cache, value_cache = (cache[:, side].to(dtype) for side in (0, 1))
    query = torch.cat(rotated_queries).to(dtype)
    return raw, query, key_cache, value_cache, block_table, query_start, seq_lens, inv_freq


def expected(method, raw, inv_freq, scaling):
    """Each request's last queries by the dense reference, concatenated: ``[T, Hq, D]``."""
    outs = []
    for (q, k, v), (n, q_len) in zip(raw, REQUESTS):
        positions = torch.arange(n)
        P = method.layer_positions(positions[None, -q_len:, None], positions[None, None, :], 0)
        out = reference.dense_attention(q[None, :, -q_len:], k[None], v[None], P, inv_freq, scaling)
        outs.append(out[0])  # [Lq, Hq, D]
    return torch.cat(outs)


@pytest.mark.parametrize("name, params", METHODS)
@pytest.mark.parametrize("keys", ["plain", "transposed"])
def test_every_method_matches_the_reference_for_a_mixed_batch(name, params, keys):
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
    assert (got - expected(method, raw, inv_freq, 0.3)).abs().max() <= 2e-5


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
    for (q, k, v), (n, q_len) in zip(raw, REQUESTS):
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


@pytest.mark.parametrize("name, params", [METHODS[1], METHODS[4], METHODS[6], METHODS[7]])
@pytest.mark.parametrize("transposed", [False, True])
def test_the_tiled_path_by_request_matches_the_reference(name, params, transposed):
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
    assert (got - expected(method, raw, inv_freq, 0.3)).abs().max() <= 2e-5


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

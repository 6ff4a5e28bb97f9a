"""A paged cache in vLLM's layout (shuffled blocks, a block table) holding a mixed batch of requests -- prefill,
a chunk, a prefix hit, decoding steps -- and the float64 dense reference's answer for it: the CPU kernel's tests
(tests/test_paged.py) and the CUDA backend's algorithm with FlashAttention emulated (:func:`run`:
tests/test_paged_flash.py, tests/test_vllm.py)."""

import torch

from helpers import flash_emulation
from helpers.cases import inv_freq_for
from longreach.attention import reference
from longreach.attention.cells import key_views, lower
from longreach.attention.paged_flash import Requests, flash_cells, flash_dual_chunk, write_moved_keys
from longreach.attention.rotary import rotate

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
    for (n, q_len), count in zip(REQUESTS, blocks_needed, strict=True):
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
    for (q, k, v), (n, q_len) in zip(raw, REQUESTS, strict=True):
        positions = torch.arange(n)
        P = method.layer_positions(positions[None, -q_len:, None], positions[None, None, :], 0)
        out = reference.dense_attention(q[None, :, -q_len:], k[None], v[None], P, inv_freq, scaling)
        outs.append(out[0])  # [Lq, Hq, D]
    return torch.cat(outs)


def run(method, dtype=torch.float32, window=None, block_size=128):
    """The CUDA backend's calls (:mod:`longreach.attention.paged_flash`) on :func:`paged_case` through the emulated
    FlashAttention and merge: ``(output, the reference's, the cells)``."""
    raw, query, key_cache, value_cache, block_table, query_start, seq_lens, inv_freq = paged_case(block_size, dtype)
    key_cache, value_cache = key_cache.transpose(1, 2), value_cache.transpose(1, 2)  # FlashAttention's layout
    cells = lower(method.parts(), window)
    blocks, block_size, kv_heads, dim = key_cache.shape
    planes = [torch.zeros(blocks * block_size + 1, kv_heads, dim, dtype=dtype) for _ in key_views(cells)[0]]
    for row, n in enumerate(seq_lens.tolist()):  # every key as vLLM caches it: its slot, its position
        positions = torch.arange(n)
        slots = block_table[row].long()[positions // block_size] * block_size + positions % block_size
        keys = key_cache.reshape(-1, kv_heads, dim)[slots]
        write_moved_keys(planes, keys, slots, cells, positions, inv_freq.float())
    write_moved_keys(planes, keys[:2], torch.tensor([-1, -1]), cells, positions[:2], inv_freq.float())  # padding
    output = torch.full_like(query, float("nan"))
    moved = [plane[:-1].view(key_cache.shape) for plane in planes]
    requests = Requests(
        block_table.int(), query_start.int(), seq_lens.int(), max(q for _, q in REQUESTS), int(seq_lens.max())
    )
    calls = (inv_freq.float(), 0.3, flash_emulation.flash_attn_varlen_func, flash_emulation.merge_attn_states, output)
    if method.name == "dca":
        flash_dual_chunk(query, key_cache, value_cache, moved[0], requests, method.parts(), method.chunk, *calls)
    else:
        flash_cells(query, key_cache, value_cache, moved, requests, cells, *calls)
    return output, expected(method, raw, inv_freq, 0.3), cells

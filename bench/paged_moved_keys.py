"""Moved keys in vLLM's paged cache: turned by the kernel as it reads them, or read from planes of keys moved once.

    .venv/bin/python bench/paged_moved_keys.py [--length 8192] [--requests 4] [--rounds 7]

One layer of the default model's shape (bench/smollm2-135m.json: 9 query heads, 3 key/value heads, head dim 64) over
a paged cache (blocks of 128, shuffled), ``--requests`` requests of ``--length`` keys: a decoding step (one query per
request) and the prefill of the last 512 queries of each. Each method's kernel time with its moved keys turned as read
and read from planes, against plain RoPE (one causal cell, what stock attention computes) in the same run,
interleaved; medians of ``--rounds``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from longreach.attention.cells import key_views, lower
from longreach.attention.paged import KeyAngles, paged_attention
from longreach.attention.rotary import apply_rotation
from longreach.attention.shifts import shift_angles
from longreach.methods import create

SHAPE = json.loads(Path(__file__).with_name("smollm2-135m.json").read_text())
METHODS = {"rope": {}, "rerope": {}, "self_extend": {}, "dca": {}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    q_heads, kv_heads = SHAPE["num_attention_heads"], SHAPE["num_key_value_heads"]
    dim = SHAPE["hidden_size"] // q_heads
    window = SHAPE["max_position_embeddings"]
    inv_freq = 1.0 / (SHAPE["rope_parameters"]["rope_theta"] ** (torch.arange(0, dim, 2).float() / dim))
    block_size, per_request = 128, -(-args.length // 128)
    blocks = args.requests * per_request
    g = torch.Generator().manual_seed(0)
    key_cache = torch.randn(blocks, kv_heads, block_size, dim, generator=g)
    value_cache = torch.randn(blocks, kv_heads, block_size, dim, generator=g)
    block_table = torch.randperm(blocks, generator=g).view(args.requests, per_request).to(torch.int32)
    seq_lens = torch.full((args.requests,), args.length)
    steps = {"decode": 1, "prefill 512": 512}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.requests} x {args.length} keys")
    print("| step | method | turned as read (ms) | planes (ms) | RoPE (ms) | turned / RoPE | planes / RoPE |")
    print("|---|---|---|---|---|---|---|")
    for step, q_len in steps.items():
        query = torch.randn(args.requests * q_len, q_heads, dim, generator=g)
        query_start = torch.arange(args.requests + 1) * q_len
        times = {}
        cases = {}
        for name in METHODS:
            method = create(name, training_window=window)
            cells = lower(method.parts(), None)
            angles = KeyAngles(inv_freq)
            planes = [_moved(key_cache, block_table, shift, inv_freq) for shift in key_views(cells)[0]]
            cases[(name, "turned")] = (cells, angles, None)
            cases[(name, "planes")] = (cells, angles, planes)
        for _ in range(args.rounds):  # interleaved
            for key, (cells, angles, planes) in cases.items():
                start = time.perf_counter()
                paged_attention(
                    query, key_cache, value_cache, block_table, query_start, seq_lens, cells, inv_freq, 0.125,
                    angles, planes,
                )  # fmt: skip
                times.setdefault(key, []).append(time.perf_counter() - start)
        rope = statistics.median(times[("rope", "turned")]) * 1e3
        for name in METHODS:
            if name == "rope":
                continue
            turned, planes = (statistics.median(times[(name, how)]) * 1e3 for how in ("turned", "planes"))
            ratios = f"{turned / rope:.2f} | {planes / rope:.2f}"
            print(f"| {step} | {name} | {turned:.2f} | {planes:.2f} | {rope:.2f} | {ratios} |")


def _moved(key_cache, block_table, shift, inv_freq):
    """The cache's keys moved by ``shift`` at their positions (a plane written once, as the keys are cached)."""
    moved = torch.empty_like(key_cache)
    block_size = key_cache.shape[2]
    for index in range(block_table.shape[1]):
        positions = torch.arange(index * block_size, (index + 1) * block_size)
        cos, sin = (side[0, 0] for side in shift_angles(shift, positions[None], inv_freq, torch.float32))
        rows = block_table[:, index].long()
        moved[rows] = apply_rotation(key_cache[rows], cos, sin)
    return moved


if __name__ == "__main__":
    main()

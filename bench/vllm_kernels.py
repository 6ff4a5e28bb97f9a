"""One layer's attention on vLLM's paged CPU cache: longreach's kernel for each method against vLLM's own CPU kernel.

    .venv-vllm/bin/python bench/vllm_kernels.py [--length 8192] [--requests 4] [--chunk 4096] [--layers 30]
        [--methods rope,string,dca,rerope,self_extend] [--rounds 9] [--keys vllm|plain] [--write]

Where bench/vllm_throughput.py times a whole engine, this times the one call a layer makes, as the backends make it:
vLLM's ``cpu_attention_with_kv_cache`` on a cache its ``cpu_attn_reshape_and_cache`` wrote (its "vec" layout: keys
transposed per block), and :mod:`longreach.attention.paged` on the same cache, as our backend reads it in float32
(``--keys plain``: on the plain layout it writes where vLLM's layout interleaves, as for bfloat16 on AMX), the call's
Python included, and the step's layout, built once per step as the backend does. The default model's shape
(bench/smollm2-135m.json: 9 query heads, 3 key/value heads, head dim 64), float32, blocks of 128 in a shuffled order.
Two steps: a decoding step (one query for each of ``--requests`` sequences of ``--length`` keys) and a prefill chunk
(the last ``--chunk`` queries of one sequence). ``--layers`` caches, one per layer, are taken in turn, so that the
keys come from memory as they do in a model, not from the last call's caches (``--layers 1``: warm). Interleaved
rounds, medians; the ratios are against vLLM's kernel in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

SHAPE = json.loads(Path(__file__).with_name("smollm2-135m.json").read_text())
BLOCK = 128


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--chunk", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--methods", default="rope,string,dca,rerope,self_extend")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--keys", choices=["vllm", "plain"], default="vllm", help="the key layout longreach reads")
    parser.add_argument("--write", action="store_true", help="write the table into bench/RESULTS.md")
    args = parser.parse_args()
    q_heads, kv_heads = SHAPE["num_attention_heads"], SHAPE["num_key_value_heads"]
    dim = SHAPE["hidden_size"] // q_heads
    per_request = -(-args.length // BLOCK)
    blocks = args.requests * per_request
    g = torch.Generator().manual_seed(0)
    block_table = torch.randperm(blocks, generator=g).view(args.requests, per_request).to(torch.int32)
    keys = [torch.randn(args.requests * args.length, kv_heads, dim, generator=g) for _ in range(2)]
    slots = (block_table.long()[:, :, None] * BLOCK + torch.arange(BLOCK)).view(args.requests, -1)[:, : args.length]
    plain, stock = _caches(args.layers, blocks, kv_heads, dim, keys, slots.reshape(-1))
    transposed = args.keys == "vllm"
    ours = [(key.view(blocks, kv_heads, dim, BLOCK), value) for key, value in stock] if transposed else plain
    steps = {
        "decoding step": (args.requests, torch.arange(args.requests + 1), torch.full((args.requests,), args.length)),
        f"prefill of {args.chunk}": (args.chunk, torch.tensor([0, args.chunk]), torch.tensor([args.length])),
    }
    rows = ["| step | method | vLLM's kernel (ms) | longreach (ms) | / vLLM's |", "|---|---|---|---|---|"]
    for step, (tokens, query_start, seq_lens) in steps.items():
        query = torch.randn(tokens, q_heads, dim, generator=g)
        table = block_table[: len(seq_lens)].contiguous()
        calls = {"vllm": _vllm_call(query, table, query_start.int(), seq_lens.int(), q_heads, kv_heads, dim)}
        for name in args.methods.split(","):
            calls[name] = _longreach_call(name, query, table, query_start, seq_lens, dim, transposed)
        if "rope" in calls:  # the same attention from the same keys: the two caches hold what they should
            difference = (calls["rope"](*ours[0]) - calls["vllm"](*stock[0])).abs().max().item()
            print(f"{step}: rope against vLLM's kernel, largest difference {difference:.1e}", flush=True)
        layers = args.layers if tokens < 64 else min(args.layers, 2)  # a prefill chunk reads its keys many times
        milliseconds = _milliseconds(calls, stock, ours, layers, args.rounds)
        base = milliseconds.pop("vllm")
        for name, median in milliseconds.items():
            rows.append(f"| {step} | {name} | {base:.2f} | {median:.2f} | {median / base:.2f}x |")
        print("\n".join(rows[-len(calls) + 1 :]), flush=True)
    table = "\n".join(rows)
    print(table)
    if args.write:
        _write(args, table, transposed)


def _milliseconds(calls: dict, stock: list, ours: list, layers: int, rounds: int) -> dict[str, float]:
    """Per call, the median milliseconds per layer over ``rounds`` rounds after a warm-up, the calls taking turns;
    vLLM's kernel reads ``stock``'s caches, longreach's ``ours``."""
    times = {name: [] for name in calls}
    for round in range(rounds + 1):  # the first: a warm-up
        for name, call in calls.items():
            caches = stock if name == "vllm" else ours
            start = time.perf_counter()
            for layer in range(layers):
                call(*caches[layer]) if name == "vllm" else call(*caches[layer], layer == 0)
            if round:
                times[name].append((time.perf_counter() - start) / layers)
    return {name: statistics.median(values) * 1e3 for name, values in times.items()}


def _write(args, table: str, transposed: bool) -> None:
    """The table into its section of bench/RESULTS.md, with the command and the set-up."""
    from results import machine, write_section

    command = (
        f"`.venv-vllm/bin/python bench/vllm_kernels.py --length {args.length} --requests {args.requests} "
        f"--chunk {args.chunk} --layers {args.layers} --methods {args.methods} --rounds {args.rounds} "
        f"--keys {args.keys}`"
    )
    header = (
        f"vLLM {__import__('vllm').__version__}; one layer of the default model's shape, float32, blocks of "
        f"{BLOCK}; longreach reads {'vLLM' if transposed else 'the plain'} layout; {args.layers} layers' caches "
        f"taken in turn; {machine('cpu')}, {torch.get_num_threads()} threads."
    )
    write_section(
        f"vLLM's CPU kernel against longreach's, {args.requests} x {args.length}, {args.keys} keys",
        f"{command}\n\n{header}\n\n{table}",
    )


def _caches(layers, blocks, kv_heads, dim, keys, slots):
    """Per layer, ``(key, value)`` planes of the plain layout and of vLLM's, holding the same keys and values."""
    from vllm import _custom_ops as ops

    plain, stock = [], []
    for _ in range(layers):
        ours = torch.zeros(blocks, kv_heads, BLOCK, 2 * dim)
        key, value = ours.view(blocks, kv_heads, 2 * BLOCK, dim).chunk(2, dim=2)
        key[slots // BLOCK, :, slots % BLOCK] = keys[0]
        value[slots // BLOCK, :, slots % BLOCK] = keys[1]
        plain.append((key, value))
        theirs = torch.zeros_like(ours)
        key, value = theirs.view(blocks, kv_heads, 2 * BLOCK, dim).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(keys[0], keys[1], key, value, slots, "vec")
        stock.append((key, value))
    return plain, stock


def _vllm_call(query, block_table, query_start, seq_lens, q_heads, kv_heads, dim):
    from vllm import _custom_ops as ops

    schedule = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(seq_lens), num_heads=q_heads, num_kv_heads=kv_heads, head_dim=dim, seq_lens=seq_lens,
        dtype=torch.float32, query_start_loc=query_start, causal=True, sliding_window_size=-1, isa="vec",
        enable_kv_split=True,
    )  # fmt: skip
    output = torch.empty_like(query)

    def call(key_cache, value_cache):
        ops.cpu_attention_with_kv_cache(
            query=query, key_cache=key_cache, value_cache=value_cache, output=output, query_start_loc=query_start,
            seq_lens=seq_lens, scale=dim**-0.5, causal=True, alibi_slopes=None, sliding_window=-1,
            block_table=block_table, softcap=0.0, scheduler_metadata=schedule, s_aux=None,
        )  # fmt: skip
        return output

    return call


def _longreach_call(name, query, block_table, query_start, seq_lens, dim, transposed):
    from longreach.attention.cells import lower
    from longreach.attention.paged import KeyAngles, attend, step_layout
    from longreach.methods import create

    inv_freq = 1.0 / (SHAPE["rope_parameters"]["rope_theta"] ** (torch.arange(0, dim, 2).float() / dim))
    cells = lower(create(name, training_window=SHAPE["max_position_embeddings"]).parts(), None)
    angles = KeyAngles(inv_freq)
    output = torch.empty_like(query)
    step = []

    def call(key_cache, value_cache, first_layer=True):
        if first_layer:  # the step's layout, which the backend builds once for the layers of a step
            step[:] = [
                step_layout(
                    block_table, query_start, seq_lens, len(query), cells, inv_freq, angles, keys_transposed=transposed
                )
            ]
        output[:] = attend(query, key_cache, value_cache, step[0], dim**-0.5)
        return output

    return call


if __name__ == "__main__":
    main()

"""Throughput in vLLM with longreach's plugin against stock vLLM, in the same run (``make test-vllm``'s environment).

    .venv-vllm/bin/python bench/vllm_throughput.py [--length 8192] [--requests 4] [--new-tokens 32]
        [--methods string,dca,rerope,self_extend] [--dtype float32] [--rounds 2] [--write]

    (the tiled path: --methods dpe,drop,dynamic_drop)

The default model's shape (bench/smollm2-135m.json) with random weights, saved to a temporary folder; ``--requests``
prompts of ``--length`` random token ids each, submitted together (vLLM batches them), greedy, ``--new-tokens`` each.
Per method one engine (the record is read when it loads); stock vLLM before the methods and again after them. Prompt
throughput: fresh prompts' tokens over the time of a run that generates one token. Generated throughput: the tokens
of a run of ``--new-tokens`` over its time, on prompts the prefix cache holds already (only their last, partial
block is computed again), so that the time is decoding's. The cache holds every set of prompts at once (its size is
set, not a share of the memory), and each engine is shut down before the next starts. Ratios are against stock's
median, measured in the same process; ``--write`` puts the table in bench/RESULTS.md. Each method runs with its
defaults, but DPE, which runs with pairs selected per layer and head (:func:`params_of`): that and the drop methods
are what vLLM's CPU backend computes by the tiled path, request by request.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

SHAPE = Path(__file__).with_name("smollm2-135m.json")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--methods", default="string,dca,rerope,self_extend")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=2, help="timed runs per engine (the median)")
    parser.add_argument("--write", action="store_true", help="write the table into bench/RESULTS.md")
    args = parser.parse_args()
    # vLLM keeps one core for its front end by default: on a machine of two, every core to the engine
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{os.cpu_count() - 1}")
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from longreach.integrations.vllm import overrides

    config = LlamaConfig.from_json_file(SHAPE)
    window = config.max_position_embeddings  # the methods' L: the default model's 8192
    config.max_position_embeddings = max(window, args.length + args.new_tokens)  # vLLM's limit, not the methods'
    rng = random.Random(0)
    prompts = [
        [[rng.randrange(3, config.vocab_size) for _ in range(args.length)] for _ in range(args.requests)]
        for _ in range(1 + args.rounds)
    ]  # the first set is cached for the decoding runs; each prefill round has its own
    rows = ["| engine | prompt tokens / s | / stock | generated tokens / s | / stock |", "|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as folder:
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(folder)
        engines = ["stock", *args.methods.split(","), "stock"]
        measured = {}
        for engine in engines:
            params = params_of(engine, config)
            record = {} if engine == "stock" else {"hf_overrides": overrides(engine, training_window=window, **params)}
            measured.setdefault(engine, []).append(throughput(folder, prompts, args, record))
            print(engine, measured[engine][-1], flush=True)
    stock = [statistics.median(values) for values in zip(*measured["stock"], strict=True)]
    for engine in dict.fromkeys(engines):
        prompt, generated = measured[engine][0] if engine != "stock" else stock
        rows.append(
            f"| {engine} | {prompt:.0f} | {prompt / stock[0]:.2f}x | {generated:.1f} | {generated / stock[1]:.2f}x |"
        )
    table = "\n".join(rows)
    print(table)
    if args.write:
        from results import machine, write_section

        command = (
            f"`.venv-vllm/bin/python bench/vllm_throughput.py --length {args.length} --requests {args.requests} "
            f"--new-tokens {args.new_tokens} --methods {args.methods} --dtype {args.dtype} --rounds {args.rounds}`"
        )
        header = (
            f"vLLM {__import__('vllm').__version__} on the CPU backend, the default model's shape with random weights, "
            f"{args.dtype}, L = {window}, {args.requests} requests of {args.length} tokens together, {args.new_tokens} "
            f"generated each; "
            f"{machine('cpu')}. Stock: the median of a run before the methods and one after."
        )
        write_section(
            f"vLLM throughput, {args.requests} x {args.length} tokens, {args.methods}",
            f"{command}\n\n{header}\n\n{table}",
        )


def params_of(method: str, config) -> dict:
    """The parameters ``method`` runs with: DPE's as after ``longreach calibrate dpe`` (its paper's four groups, the
    three quarters of each head's pairs most important to it changed; random importances here), the defaults else."""
    if method != "dpe":
        return {}
    import torch

    pairs = config.head_dim // 2
    shape = (config.num_hidden_layers, config.num_attention_heads, pairs)
    importance = torch.rand(shape, generator=torch.Generator().manual_seed(0))
    return {"group_scales": (2, 3, 1, 4), "top_k": 3 * pairs // 4, "dimensions": importance}


def throughput(folder: str, prompts: list, args, record: dict) -> tuple[float, float]:
    """``(prompt tokens / s, generated tokens / s)`` of one engine: medians over ``args.rounds`` timed runs after a
    warm-up."""
    from transformers import AutoConfig
    from vllm import LLM

    config = AutoConfig.from_pretrained(folder)
    tokens = len(prompts) * len(prompts[0]) * (args.length + args.new_tokens + 128)  # every set, each block rounded up
    width = 4 if args.dtype == "float32" else 2
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * width  # keys, values
    llm = LLM(
        model=folder,
        skip_tokenizer_init=True,
        dtype=args.dtype,
        max_model_len=args.length + args.new_tokens,
        enable_prefix_caching=True,  # the decoding runs read their prompts from the cache
        kv_cache_memory_bytes=tokens * per_token,  # every set of prompts held at once: none evicted before reuse
        seed=0,
        **record,
    )
    try:
        return timed_runs(llm, prompts, args)
    finally:  # the engine's processes end here, before the next engine starts and reserves its memory
        llm.llm_engine.engine_core.shutdown()


def timed_runs(llm, prompts: list, args) -> tuple[float, float]:
    """``(prompt tokens / s, generated tokens / s)`` of an engine (see :func:`throughput`)."""
    from vllm import SamplingParams

    def seconds(batch: list, tokens: int) -> float:
        sampling = SamplingParams(max_tokens=tokens, min_tokens=tokens, temperature=0, detokenize=False)
        began = time.perf_counter()
        llm.generate([{"prompt_token_ids": ids} for ids in batch], sampling, use_tqdm=False)
        return time.perf_counter() - began

    cached, fresh = prompts[0], prompts[1:]
    seconds(cached, 1)  # warm-up, and the decoding runs' prompts into the prefix cache
    prefill = statistics.median(seconds(batch, 1) for batch in fresh)
    decoding = statistics.median(seconds(cached, args.new_tokens) for _ in range(args.rounds))
    return len(cached) * len(cached[0]) / prefill, len(cached) * args.new_tokens / decoding


if __name__ == "__main__":
    main()

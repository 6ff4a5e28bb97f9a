"""The first minutes of a GPU session: does every path that has never run on a GPU work, which backend does
``auto`` take, and what does each route cost against SDPA, in one short run (bench/gpu.sh, part 1).

    OUT=folder python bench/gpu_probe.py [--device cuda|cpu] [--part all|kernels|generate]

Every item runs on its own (a failure is a finding, written as ``ERROR ...``), and ``$OUT/gpu_probe.json``
(``gpu_probe_PART.json`` for one part: bench/gpu.sh gives each its own time budget and process) is rewritten after
each, so a run cut short keeps what it measured. The Triton kernel runs last of each group, and ``generate`` (whose
decoding steps take it too, eager and compiled) last of all: an illegal address is sticky and would poison what
follows. Checks compare with the math backend in float32 on the same bfloat16 inputs; times are
CUDA events (the CPU: wall clock), medians of 5 after one warm-up.

``ran``: for each backend timed, the backends whose ``run`` computed its calls -- the one named, or the one it
handed the calls to (``kernel._run``), or, for ``auto``, the one it chose (issue 53, item 3: which kernel ran).

``generate``: ``generate`` under CUDA graphs, as docs/integrations.md recommends (a static cache,
``CompileConfig(fullgraph=True, mode="reduce-overhead")``), for stock SDPA, STRING and ReRoPE (each method's
defaults), on the default model's shape (bench/smollm2-135m.json: 9 query / 3 KV heads of 64, 576 wide, a vocabulary
of 49152) with random weights in bfloat16, after a prompt of 16384 tokens (twice its training window) -- with
2 of its 30 layers, as Dynamo and Inductor take time per layer: a method's difference to SDPA per token is that of
2 layers (the full model's is 15 times as much), the rest of a step (embedding, head, sampling) is the same.
Per method: how many of the first 8 tokens are those of eager generation (greedy) and the largest logit difference up
to the first that is not (random weights in bfloat16 have near ties), and milliseconds per generated token,
``(generate 32 tokens - generate 2 tokens) / 30`` after a warm-up ``generate`` that compiles. Two, not one: each
``generate`` builds a new static cache, whose new addresses may make CUDA graphs record again at the first decoding
step, which both then pay (one token would be the prefill alone). The CPU dry run goes the same way, small: one layer
in float32, a prompt of 256 tokens (twice the training window it is given), 10 tokens against 2, one round, traced by
Dynamo without Inductor (``backend="eager"``).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from model import SHAPE  # bench/model.py: the default model's config, for random weights
from results import backends_that_ran

import longreach
from longreach.attention import backends, kernel
from longreach.methods import create

RESULTS_FILE = "gpu_probe.json"  # under $OUT; gpu_probe_PART.json for one part
RESULTS: dict = {"env": {}, "checks": {}, "auto": {}, "ms": {}, "ran": {}, "peak_mib": {}, "generate": {}}
GENERATE_LAYERS = 2  # of the default model's 30: see the module's docstring


def record(kind: str, name: str, measure, *args) -> None:
    """``RESULTS[kind][name] = measure(*args)``, or the error it raised; written out at once."""
    started = time.time()
    try:
        RESULTS[kind][name] = measure(*args)
    except Exception as error:  # every failure is a finding
        RESULTS[kind][name] = f"ERROR {type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"
        traceback.print_exc(limit=3)
    print(f"[{time.time() - started:6.1f} s] {kind}/{name}: {RESULTS[kind][name]}", flush=True)
    (Path(os.environ.get("OUT", "bench/out")) / RESULTS_FILE).write_text(json.dumps(RESULTS, indent=1, default=str))


def timed(run, device: torch.device, rounds: int = 5) -> float:
    """Median milliseconds of ``run()`` after one warm-up."""
    run()
    times = []
    for _ in range(rounds):
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop))
        else:
            began = time.perf_counter()
            run()
            times.append((time.perf_counter() - began) * 1000)
    return round(statistics.median(times), 3)


def layer(n: int, device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, dim: int):
    """Random rotated ``q``, ``k``, ``v`` of a layer, and its ``inv_freq``."""
    generator = torch.Generator(device=device).manual_seed(0)
    q, k, v = (
        torch.randn(1, h, n, dim, device=device, dtype=dtype, generator=generator) for h in (heads, kv_heads, kv_heads)
    )
    return q, k, v, 1.0 / (10000 ** (torch.arange(0, dim, 2, device=device).float() / dim))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument(
        "--part", default="all", choices=["all", "kernels", "generate"], help="bench/gpu.sh runs each on its own budget"
    )
    arguments = parser.parse_args()
    device, cuda = torch.device(arguments.device), arguments.device == "cuda"
    if arguments.part != "all":
        global RESULTS_FILE
        RESULTS_FILE = f"gpu_probe_{arguments.part}.json"
    RESULTS["env"] = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if cuda else "cpu",
                      "cudnn": torch.backends.cudnn.version() if cuda else None}  # fmt: skip
    print(RESULTS["env"], flush=True)
    if arguments.part in ("all", "kernels"):
        kernels(device)
    if arguments.part in ("all", "generate"):
        generation(device)


def kernels(device: torch.device) -> None:
    """Every backend checked, ``auto``'s choices, cuDNN's grouped heads, and STRING's time, memory and kernel per
    backend against SDPA's kernels (see the module's docstring)."""
    cuda = device.type == "cuda"
    dtype, heads, kv_heads, dim = (torch.bfloat16, 32, 8, 128) if cuda else (torch.float32, 4, 2, 32)

    small = 1000 if cuda else 200
    q, k, v, inv_freq = layer(small, device, dtype, heads, kv_heads, dim)
    _checks(q, k, v, inv_freq, small, cuda)
    for what, length in (("prefill", 4096), ("decoding step", 1)):
        query = torch.empty(1, heads, length, dim, device=device, dtype=dtype)
        record("auto", what, _picked, query)
    if cuda:
        cudnn = torch.ops.aten._scaled_dot_product_cudnn_attention
        record(
            "checks",
            "cudnn_op_takes_grouped_heads",
            lambda: list(cudnn(q, k, v, None, True, 0.0, True, False)[0].shape),
        )

    for n in (8192, 32768, 131072) if cuda else (512, 1024):
        _times(n, device, dtype, heads, kv_heads, dim)


def _checks(q, k, v, inv_freq, window: int, cuda: bool) -> None:
    """Every backend's largest difference from the math backend's, for STRING, ReRoPE and DCA."""
    for name in ("string", "rerope", "dca"):
        parts = create(name, training_window=window).parts()
        want = kernel.attention(q.float(), k.float(), v.float(), parts, inv_freq, backend="math")
        on_cpu = ["auto", "cpu_fused", "cpu_flash", "flex", "math"]
        on_cuda = [b for b in backends.names() if b not in ("triton", "cpu_fused", "cpu_flash")] + ["triton"]
        names = on_cuda if cuda else on_cpu  # Triton last
        for backend in names:
            record("checks", f"{name}_{backend}_max_error", max_error, q, k, v, parts, inv_freq, backend, want)


def _picked(query: torch.Tensor) -> str:
    return backends.pick(query, "auto", fusable=True).name


def _times(n: int, device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, dim: int) -> None:
    """At ``n`` tokens: SDPA's time (on CUDA: forced to flash and to cuDNN, and cuDNN's op returning its
    log-sum-exp), and STRING's time, kernels and (on CUDA) peak memory per backend."""
    cuda = device.type == "cuda"
    q, k, v, inv_freq = layer(n, device, dtype, heads, kv_heads, dim)
    parts = create("string", training_window=n).parts()
    sdpa = functools.partial(F.scaled_dot_product_attention, q, k, v, is_causal=True, enable_gqa=True)
    record("ms", f"sdpa_{n}", timed, sdpa, device)
    if cuda:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        for kind in ("FLASH_ATTENTION", "CUDNN_ATTENTION"):
            record("ms", f"sdpa_{kind.lower()}_{n}", _forced, kind, sdpa, device, SDPBackend, sdpa_kernel)
        # what cuda_cudnn calls: cuDNN's causal attention returning its log-sum-exp, keys grouped or repeated
        cudnn = torch.ops.aten._scaled_dot_product_cudnn_attention
        repeated = [x.repeat_interleave(heads // kv_heads, dim=1) for x in (k, v)]
        with_lse = functools.partial(cudnn, q, *repeated, None, True, 0.0, True, False)
        record("ms", f"cudnn_with_lse_{n}", timed, with_lse, device)
        grouped = functools.partial(cudnn, q, k, v, None, True, 0.0, True, False)  # if cuDNN takes them
        record("ms", f"cudnn_with_lse_grouped_heads_{n}", timed, grouped, device)
        del repeated, with_lse, grouped
    names = ("auto", "cuda_cudnn", "flex", "cuda_flash", "triton") if cuda else ("auto", "cpu_flash")
    for backend in names:
        run = functools.partial(kernel.attention, q, k, v, parts, inv_freq, backend=backend)
        with backends_that_ran() as ran:
            record("ms", f"string_{backend}_{n}", timed, run, device)
        record("ran", f"string_{backend}_{n}", lambda: list(dict.fromkeys(ran)))
        if cuda:
            record("peak_mib", f"string_{backend}_{n}", _peak, run)
    if cuda:
        torch.cuda.empty_cache()


@torch.no_grad()
def generation(device: torch.device) -> None:
    """``generate`` under CUDA graphs for stock SDPA, STRING and ReRoPE: its tokens against eager generation's, and
    its time per token (see the module's docstring)."""
    cuda = device.type == "cuda"
    length, layers, many, dtype = (16384, GENERATE_LAYERS, 32, torch.bfloat16) if cuda else (256, 1, 10, torch.float32)
    config = transformers.LlamaConfig.from_json_file(SHAPE)
    config.num_hidden_layers = layers
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model = model.to(device).eval()
    ids = torch.randint(100, 20000, (1, length), generator=torch.Generator().manual_seed(0)).to(device)
    if cuda:
        compiled = transformers.CompileConfig(fullgraph=True, mode="reduce-overhead")
    else:
        compiled = transformers.CompileConfig(fullgraph=True, backend="eager", mode=None)
        compiled._compile_all_devices = True  # transformers compiles on accelerators only, unless told

    def generate(new_tokens: int, **settings):
        """The greedy continuation of the prompt, ``new_tokens`` tokens, with a static cache, and its logits."""
        return model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            cache_implementation="static",
            output_logits=True,
            return_dict_in_generate=True,
            **settings,
        )

    def against_eager() -> dict:
        """The compiled steps against eager ones, on their first 8 tokens: how many agree before the first that does
        not (random weights in bfloat16 have near ties), and the largest logit difference up to there."""
        eager = generate(8, disable_compile=True)
        compiled_run = generate(many, compile_config=compiled)  # compiles: the warm-up
        tokens = compiled_run.sequences[0, length : length + 8] == eager.sequences[0, length:]
        agree = int(tokens.long().cumprod(0).sum())
        steps = range(min(agree + 1, 8))  # the logits of the first disagreeing step come from the same prefix
        difference = max((compiled_run.logits[i].float() - eager.logits[i].float()).abs().max().item() for i in steps)
        return {"tokens_equal": agree, "max_logit_difference": round(difference, 4)}

    def ms_per_token() -> float:
        rounds = 5 if cuda else 1
        ms_many = timed(functools.partial(generate, many, compile_config=compiled), device, rounds)
        ms_two = timed(functools.partial(generate, 2, compile_config=compiled), device, rounds)
        return round((ms_many - ms_two) / (many - 2), 3)

    for method in ("sdpa", "string", "rerope"):
        torch._dynamo.reset()  # each method compiled afresh: its time does not depend on the order
        if method == "sdpa":
            longreach.remove(model)
        else:
            longreach.apply(model, method, **({} if cuda else {"training_window": length // 2}))
        record("generate", f"{method}_first_8_tokens_against_eager", against_eager)
        record("generate", f"{method}_ms_per_token", ms_per_token)


def max_error(q, k, v, parts, inv_freq, backend: str, want: torch.Tensor) -> float:
    """The largest difference between ``backend``'s attention and ``want``."""
    return round((kernel.attention(q, k, v, parts, inv_freq, backend=backend).float() - want).abs().max().item(), 4)


def _forced(kind, sdpa, device, SDPBackend, sdpa_kernel) -> float:
    with sdpa_kernel(getattr(SDPBackend, kind)):
        return timed(sdpa, device)


def _peak(run) -> float:
    """Peak memory of one call beyond what was allocated before it, MiB."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    run()
    torch.cuda.synchronize()
    return round((torch.cuda.max_memory_allocated() - before) / 2**20, 1)


if __name__ == "__main__":
    main()

"""End-to-end speed of every position method against stock attention, on a bundled model.

    python bench/model.py [--model default] [--length 8192] [--steps 15] [--rounds 1] [--new-tokens 64]
                          [--device cuda] [--dtype bfloat16] [--write]
                          [--methods rope,string,rerope+kept,...] [--weights random]

One process, one model. Decoding: a cache of ``--length`` tokens is filled once; each round runs one
step with stock ``sdpa`` and one with each method against it (the cache is cropped back after each
step: a step's time depends on the shapes, not on what the cache holds; a ``+kept`` method, whose kept keys
hold only while its cache is appended to, steps on a copy of its own); medians of ``--steps`` rounds. Prefill and
``generate(--new-tokens)``: the last position's logits only, as ``generate`` computes them (the full logits of 32K
tokens over Gemma 3's 262,144 words would take 34 GB); methods and stock alternate, ``--rounds`` times,
medians (on a GPU each method first prefills once untimed, which compiles its FlexAttention
kernels). Ratios are against stock measured in the same run. A method named with ``+kept`` (``rerope+kept``)
is applied with ``keep_moved_keys=True``. ``--weights random`` builds the default model's shape
(``bench/smollm2-135m.json``) with random weights, for a machine that has not got the model (a lent GPU
has no network, and the 98 MB GGUF is more than it can be sent): times depend on shapes, not weights.
"""

from __future__ import annotations

import argparse
import copy
import functools
import statistics
from pathlib import Path

import torch
from results import machine, timed, write_section
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig

import longreach
from longreach import models
from longreach.eval import on_model
from longreach.methods.spec import MethodSpec

METHODS = ["rope", "string", "rerope", "self_extend", "dca"]
STOCK = "sdpa (stock)"


SHAPE = Path(__file__).with_name("smollm2-135m.json")  # the default model's config, for --weights random
KEPT = "+kept"  # a method name's suffix: apply it with keep_moved_keys=True


def switch(model, method: str) -> None:
    """Stock attention, or a method as the command line writes it (``dpe:group_scales=2;4,...``; ``rerope+kept``:
    with ``keep_moved_keys``)."""
    if method == STOCK:
        longreach.remove(model)
    else:
        name = method.removesuffix(KEPT)
        on_model.apply(
            model, MethodSpec.parse(name), longreach.training_window(model.config), keep_moved_keys=name != method
        )


@torch.no_grad()
def decoding(model, ids, methods, steps) -> dict[str, list[float]]:
    cache = DynamicCache(config=model.config)
    model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    token, n = ids[:, -1:], ids.shape[1]
    sliding = any(getattr(layer, "is_sliding", False) for layer in cache.layers)
    growing = {m: copy.deepcopy(cache) for m in methods if m.endswith(KEPT)}
    times = {m: [] for m in methods}
    step = functools.partial(model, token, use_cache=True)  # one token's forward
    for _ in range(steps + 1):  # the first round warms up
        for method in methods:
            switch(model, method)
            if (
                method in growing
            ):  # kept keys hold only while the cache is appended to, never cropped: a cache of their own
                own = growing[method]  # that grows by 2 tokens a round (+0.4% at 8K after 16 rounds)
                model(
                    token, past_key_values=own, use_cache=True
                )  # untimed: switching dropped the kept keys; this keeps them
                times[method].append(timed(functools.partial(step, past_key_values=own), ids.device))
                continue
            if sliding:  # a sliding layer's cache cannot be cropped back: each step on a copy (untimed)
                times[method].append(timed(functools.partial(step, past_key_values=copy.deepcopy(cache)), ids.device))
                continue
            times[method].append(timed(functools.partial(step, past_key_values=cache), ids.device))
            cache.crop(n - cache.get_seq_length())  # transformers 5: a negative count of tokens to drop
    return {m: t[1:] for m, t in times.items()}


@torch.no_grad()
def prefill_and_generate(model, ids, methods, rounds, new_tokens) -> tuple[dict, dict]:
    prefill, generate = {m: [] for m in methods}, {m: [] for m in methods}
    settings = dict(
        max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, attention_mask=torch.ones_like(ids)
    )
    for i in range(rounds):
        for method in methods:
            switch(model, method)
            if i == 0 and ids.device.type == "cuda":
                model(ids, use_cache=True, logits_to_keep=1)  # untimed: compiles its FlexAttention variants
            prefill[method].append(timed(lambda: model(ids, use_cache=True, logits_to_keep=1), ids.device))
            if new_tokens:
                generate[method].append(timed(lambda: model.generate(ids, **settings), ids.device))
    return prefill, generate


def table(title: str, times: dict[str, list[float]], unit: float, unit_name: str) -> list[str]:
    base = statistics.median(times[STOCK])
    rows = [f"| {title} | median ({unit_name}) | / stock |", "|---|---|---|"]
    for method, values in times.items():
        if values:
            median = statistics.median(values)
            rows.append(f"| {method} | {median / unit:.1f} | {median / base:.2f}x |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="default", help="a bundled model (default, gemma3-270m) or a model's path")
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=15, help="decoding rounds (medians)")
    parser.add_argument("--rounds", type=int, default=1, help="prefill / generate rounds (medians)")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens for the generate timing (0: skip it)")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument(
        "--method",
        action="append",
        default=[],
        help="one more method with parameters, repeatable, "
        "e.g. dpe:group_scales=2;2;2;2;2;2;2;2,top_k=24,dimensions=runs/calibrate_dpe_8k/dimensions.safetensors",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument(
        "--write", action="store_true", help="also write the tables into their section of bench/RESULTS.md"
    )
    parser.add_argument(
        "--weights",
        default="default",
        choices=["default", "random"],
        help="random: the default model's shape with random weights (no model files needed)",
    )
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    if args.weights == "random":
        config = LlamaConfig.from_json_file(SHAPE)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").to(args.device).eval()
    else:
        model, _ = models.load(args.model, dtype=dtype, device=args.device)
    ids = torch.randint(100, 20000, (1, args.length), generator=torch.Generator().manual_seed(0)).to(args.device)
    methods = [STOCK, *filter(None, args.methods.split(",")), *args.method]
    weights = " (random weights)" if args.weights == "random" else ""
    text = model.config.get_text_config()
    name = models.BUNDLED[args.model].title if args.model in models.BUNDLED else args.model
    header = (
        f"{name}{weights} ({text.num_hidden_layers} layers, {text.num_attention_heads} query / "
        f"{text.num_key_value_heads} KV heads), {args.dtype}, batch 1, {args.length} tokens, "
        f"{machine(args.device)}; "
        f"L = {longreach.training_window(model.config)} (each method's defaults)."
    )
    print(header, flush=True)
    steps = decoding(model, ids, methods, args.steps)
    lines = table(f"decoding step against {args.length} cached tokens ({args.steps} rounds)", steps, 1e-3, "ms")
    print("\n".join(lines), flush=True)
    prefill, generate = prefill_and_generate(model, ids, methods, args.rounds, args.new_tokens)
    lines += [""] + table(f"prefill of {args.length} tokens ({args.rounds} rounds)", prefill, 1, "s")
    if args.new_tokens:
        lines += [""] + table(
            f"generate {args.new_tokens} tokens after {args.length} ({args.rounds} rounds)", generate, 1, "s"
        )
    print("\n".join(lines[-2 * len(methods) - 5 :]), flush=True)
    if args.write:
        chosen = args.methods != ",".join(METHODS)
        extra = (f" --methods {args.methods}" if chosen else "") + "".join(f" --method '{m}'" for m in args.method)
        extra += f" --device {args.device} --dtype {args.dtype}" if args.device != "cpu" else ""
        extra += " --weights random" if args.weights == "random" else ""
        extra = (f" --model {args.model}" if args.model != "default" else "") + extra
        command = (
            f"`python bench/model.py --length {args.length} --steps {args.steps} --rounds {args.rounds} "
            f"--new-tokens {args.new_tokens}{extra}`"
        )
        names = dict.fromkeys(m.split(":")[0] for m in methods[1:])
        which = "the default model" if args.model == "default" else args.model
        title = f"End to end, {which} at {args.length} tokens" + (
            ", " + ", ".join(names) if chosen or args.method else ""
        )
        title += f", {args.device} {args.dtype}" if args.device != "cpu" else ""
        write_section(title, f"{command}\n\n{header}\n\n" + "\n".join(lines))


if __name__ == "__main__":
    main()

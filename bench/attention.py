"""Attention speed and peak memory of every method against causal SDPA, on the same q, k, v.

    python bench/attention.py [--lengths 4096,8192,16384] [--heads 8] [--kv-heads 8] [--dim 64] [--rounds 3]
                              [--methods rope,string,...] [--decode] [--memory] [--device cuda] [--dtype bfloat16]
                              [--batch 4 --left-pad 64] [--backend auto] [--write]

Time (default): in one process, SDPA and each method alternate ``--rounds`` times after a warm-up
round; the table gives the median of the per-round ratios, so a shared machine's drift cancels
(on a GPU each call is timed from an idle device until its work is done).
``--decode``: one query against ``n`` cached keys (a decoding step) instead of the causal prefill.
``--batch B --left-pad P``: B sequences, left-padded 0 to P keys (evenly spread), as an evaluation
batches prompts of one nominal length; SDPA runs the same batch causal and unpadded, so the ratio
includes what the padding costs.
``--backend``: the kernel's backend for every method (default ``auto``; ``triton``: the fused kernel,
compiled on CUDA, under ``TRITON_INTERPRET=1`` on the CPU).
``--memory``: each method in a fresh process (peak RSS is its own, warm-up included), peak growth
over the inputs against SDPA's; on the CPU the children run with a fixed glibc mmap threshold, so RSS
tracks live memory, unless ``--allocator-as-is``: then it is the RSS a user sees, heap fragmentation
included. ``--write`` puts the table in its own section of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from results import backends_that_ran, busiest_kernel, machine, timed, write_section

METHODS = {"rope": {}, "string": {}, "rerope": {}, "self_extend": {}, "dca": {}}  # defaults for L = n
LLAMA_3_SCALES = (4, 4, 2, 16, 32, 32, 16, 128)  # DPE's published Llama-3-8B-Instruct setting (w = 1024)
DPES = {
    "dpe": {"top_k": None},  # every pair: one shift per frequency group
    "dpe_top_k": {"top_k": "3/4"},
}  # 3/4 of the pairs per head (the paper's 48 of 64), chosen at random here
DROPS = {
    "drop": {"rate": 0.3},
    "dynamic_drop": {},
}  # DA at 0.3 on every row; DDA with L = n/2 (half the rows beyond it)


def case(
    method: str,
    n: int,
    heads: int,
    dim: int,
    decode: bool,
    device: str = "cpu",
    kv_heads: int | None = None,
    dtype: str = "float32",
    batch: int = 1,
    left_pad: int = 0,
    backend: str = "auto",
):
    """``(run, input_bytes)``: one call of ``method`` (or causal SDPA for ``"sdpa"``, unpadded) on fixed random
    inputs; ``batch`` sequences whose keys are left-padded 0 to ``left_pad`` (evenly spread)."""
    import torch

    from longreach.attention import kernel
    from longreach.methods import create

    generator, dtype = torch.Generator().manual_seed(0), getattr(torch, dtype)
    q = torch.randn(batch, heads, 1 if decode else n, dim, generator=generator).to(device, dtype)
    k, v = (torch.randn(batch, kv_heads or heads, n, dim, generator=generator).to(device, dtype) for _ in range(2))
    pads = [left_pad * b // max(1, batch - 1) for b in range(batch)]
    padding = torch.stack([torch.arange(n, device=device) >= pad for pad in pads]) if left_pad else None
    inputs = sum(t.numel() * t.element_size() for t in (q, k, v))
    if method == "sdpa":
        gqa = k.shape[1] != heads
        return (
            lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=not decode, enable_gqa=gqa)
        ), inputs
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, device=device).float() / dim))
    if method in DROPS:
        positions = torch.arange(n - q.shape[2], n, device=device)[None]
        rates = create(method, n // 2, **DROPS[method]).rates(
            positions, n // 2, generated=torch.full(positions.shape, decode, device=device)
        )
        parts = create("rope", training_window=n).parts()
        return (
            lambda: kernel.attention(q, k, v, parts, inv_freq, drop=rates, key_padding=padding, backend=backend)
        ), inputs
    if method in DPES:
        pairs, top_k = dim // 2, DPES[method]["top_k"]
        chosen = (
            {"top_k": None}
            if top_k is None
            else {"top_k": 3 * pairs // 4, "dimensions": torch.rand(1, heads, pairs, generator=generator)}
        )
        parts = create("dpe", training_window=n, group_scales=LLAMA_3_SCALES, **chosen).layer_parts(0)
        return (lambda: kernel.attention(q, k, v, parts, inv_freq, key_padding=padding, backend=backend)), inputs
    parts = create(method, training_window=n, **METHODS[method]).parts()
    return (lambda: kernel.attention(q, k, v, parts, inv_freq, key_padding=padding, backend=backend)), inputs


def time_ratios(
    lengths: list[int],
    methods: list[str],
    heads: int,
    dim: int,
    rounds: int,
    decode: bool,
    kv_heads: int,
    device: str,
    dtype: str,
    batch: int = 1,
    left_pad: int = 0,
    backend: str = "auto",
) -> list[str]:
    """Medians of per-round time ratios against SDPA, SDPA and the method alternating in one process."""
    rows = [
        "| method | n | SDPA (s) | SDPA's kernel | longreach's backend | median time / SDPA | min / max ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for n in lengths:
        sdpa, _ = case("sdpa", n, heads, dim, decode, device, kv_heads, dtype, batch)
        sdpa_kernel = busiest_kernel(sdpa, device)
        for method in methods:
            ours, _ = case(method, n, heads, dim, decode, device, kv_heads, dtype, batch, left_pad, backend)
            timed(sdpa, device)
            with backends_that_ran() as ran:  # the warm-up (it compiles): which backend computed the calls
                timed(ours, device)
            base, ratios = [], []
            for _ in range(rounds):
                base.append(timed(sdpa, device))
                ratios.append(timed(ours, device) / base[-1])
            backend_ran = ", ".join(dict.fromkeys(ran))  # auto's choice, or the backend a declined call went to
            rows.append(
                f"| {method} | {n} | {statistics.median(base):.4f} | {sdpa_kernel} | {backend_ran} | "
                f"{statistics.median(ratios):.2f}x | "
                f"{min(ratios):.2f} / {max(ratios):.2f} |"
            )
            print(rows[-1], flush=True)
    return rows


def peak_growth(method: str, n: int, heads: int, dim: int, decode: bool, device: str) -> dict:
    """Run in a child process: peak memory over the inputs, warm-up call included."""
    import resource

    import torch

    run, inputs = case(method, n, heads, dim, decode, device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:  # RSS: live memory with a fixed glibc mmap threshold, what a user sees without (--allocator-as-is)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    run()
    after = (
        torch.cuda.max_memory_allocated()
        if device == "cuda"
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )
    return {"peak_bytes": max(0, after - before), "input_bytes": inputs}


def memory_table(
    lengths: list[int],
    methods: list[str],
    heads: int,
    dim: int,
    decode: bool,
    device: str,
    allocator_as_is: bool = False,
) -> list[str]:
    rows = ["| method | n | peak growth (MiB) | / SDPA's | / inputs (q, k, v) |", "|---|---|---|---|---|"]
    for n in lengths:
        results = {}
        for method in ["sdpa", *methods]:
            command = [
                sys.executable,
                __file__,
                "--child",
                method,
                str(n),
                "--heads",
                str(heads),
                "--dim",
                str(dim),
                "--device",
                device,
            ] + (["--decode"] if decode else [])
            env = dict(os.environ) if allocator_as_is else {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
            results[method] = json.loads(
                subprocess.run(command, capture_output=True, text=True, check=True, env=env).stdout
            )
        base = results["sdpa"]["peak_bytes"]
        for method in ["sdpa", *methods]:
            r = results[method]
            rows.append(
                f"| {method} | {n} | {r['peak_bytes'] / 2**20:.1f} | {r['peak_bytes'] / max(base, 1):.2f}x | "
                f"{r['peak_bytes'] / r['input_bytes']:.2f}x |"
            )
            print(rows[-1], flush=True)
    return rows


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="4096,8192,16384")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument(
        "--kv-heads", type=int, help="key/value heads (default: --heads; fewer: grouped-query attention)"
    )
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds after the warm-up (medians)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument(
        "--methods",
        default=",".join(METHODS),
        help="comma-separated subset of: " + ", ".join([*METHODS, *DPES, *DROPS]),
    )
    parser.add_argument(
        "--decode", action="store_true", help="one query against n cached keys instead of the causal prefill"
    )
    parser.add_argument("--batch", type=int, default=1, help="sequences per call (timing only)")
    parser.add_argument(
        "--left-pad", type=int, default=0, help="left padding of the last sequence, 0 .. this spread over the batch"
    )
    from longreach.attention.backends import names as backend_names  # the registry: every backend the kernel has

    parser.add_argument(
        "--backend", default="auto", choices=backend_names(), help="the kernel's backend for every method (timing only)"
    )
    parser.add_argument(
        "--memory", action="store_true", help="peak memory, each method in its own process, instead of time"
    )
    parser.add_argument(
        "--allocator-as-is",
        action="store_true",
        help="--memory: the RSS a user sees (heap fragmentation "
        "included), not live memory under a fixed mmap threshold",
    )
    parser.add_argument(
        "--write", action="store_true", help="also write the table into its section of bench/RESULTS.md"
    )
    parser.add_argument("--child", nargs=2, metavar=("METHOD", "N"), help=argparse.SUPPRESS)
    return parser


def _refuse_combinations(parser: argparse.ArgumentParser, args: argparse.Namespace, methods: list[str]) -> None:
    """Stop with argparse's usage error on an unknown method of ``methods`` (``--methods``) or an option that does not
    apply to the measure."""
    unknown = sorted(set(methods) - set(METHODS) - set(DPES) - set(DROPS))
    if unknown:
        parser.error(f"--methods: unknown {', '.join(unknown)}; choose from {', '.join([*METHODS, *DPES, *DROPS])}")
    if args.memory and args.kv_heads:
        parser.error("--kv-heads: timing only (--memory measures every method with --heads key/value heads)")
    if args.memory and (args.batch != 1 or args.left_pad):
        parser.error("--batch/--left-pad: timing only (--memory measures one sequence)")
    if args.left_pad and args.batch < 2:
        parser.error(
            f"--left-pad {args.left_pad}: needs --batch 2 or more (one sequence padded 0, the last {args.left_pad})"
        )
    if args.memory and args.backend != "auto":
        parser.error("--backend: timing only (--memory measures the auto backend)")
    if args.memory and args.dtype != "float32":
        parser.error("--dtype: timing only (--memory measures float32)")


def _section_title(args: argparse.Namespace, default_methods: str, what: str, heads: str, batch: str) -> str:
    """The title of the table's section in bench/RESULTS.md: what was measured, and every option not at its
    default."""
    title = f"Attention, {what}, {'peak memory' if args.memory else 'time'}, n = {args.lengths}, {heads}"
    if args.allocator_as_is:
        title += ", the allocator as it is"
    if args.batch != 1:
        title += f", {batch}"
    if args.device != "cpu":
        title += f", {args.device} {args.dtype}"
    if args.backend != "auto":
        title += f", backend {args.backend}"
    if args.methods != default_methods:
        title += f", {args.methods}"
    return title


def main() -> None:
    parser = _parser()
    args = parser.parse_args()
    if args.child:
        print(
            json.dumps(peak_growth(args.child[0], int(args.child[1]), args.heads, args.dim, args.decode, args.device))
        )
        return
    lengths = [int(x) for x in args.lengths.split(",")]
    methods = args.methods.split(",")
    _refuse_combinations(parser, args, methods)
    what = "decoding step (1 query against n cached keys)" if args.decode else "causal prefill"
    heads = f"{args.heads} heads" + (f" ({args.kv_heads} KV)" if args.kv_heads and args.kv_heads != args.heads else "")
    batch = f"batch {args.batch}" + (
        f" left-padded 0-{args.left_pad} keys (SDPA: the batch unpadded)" if args.left_pad else ""
    )
    header = (
        f"{'Peak memory' if args.memory else 'Time'}, {what}: {args.dtype}, {batch}, {heads}, head dim {args.dim}, "
        f"{machine(args.device)}. "
        "drop: DA at rate 0.3 on every row; dynamic_drop: DDA (0.15, +0.05 per 1000 tokens, max 0.3) with L = n/2. "
        "dpe: Llama-3-8B's published scales, w = 1024, every pair; dpe_top_k: 3/4 of the pairs per head."
    )
    print(header, flush=True)
    if args.memory:
        rows = memory_table(lengths, methods, args.heads, args.dim, args.decode, args.device, args.allocator_as_is)
    else:
        rows = time_ratios(
            lengths,
            methods,
            args.heads,
            args.dim,
            args.rounds,
            args.decode,
            args.kv_heads or args.heads,
            args.device,
            args.dtype,
            args.batch,
            args.left_pad,
            args.backend,
        )
    if args.write:
        command = " ".join(["python bench/attention.py", *(a for a in sys.argv[1:] if a != "--write")])
        title = _section_title(args, parser.get_default("methods"), what, heads, batch)
        write_section(title, f"`{command}`\n\n{header}\n\n" + "\n".join(rows))


if __name__ == "__main__":
    main()

"""The FlashAttention emulation the CUDA tests rest on (``tests/helpers/flash_emulation.py``), checked against a real
kernel.

``longreach.attention.paged_flash`` (vLLM's CUDA backend) and ``cuda_flash`` are tested on the CPU through an
emulation of FlashAttention's varlen call: bottom-right causal alignment, a left window, ``seqused_k``, grouped heads,
the log-sum-exp, rows with no key. On a GPU this runs the emulation beside PyTorch's own FlashAttention-2 kernel
(``aten._flash_attention_forward``, varlen, bfloat16) on random cases of each, and prints one line per case; on the CPU
(``--device cpu``, the dry run of bench/gpu.sh) the emulation is checked against a dense float64 softmax written here
instead. Writes ``$OUT/flash_emulation.json``; exits 1 where a case disagrees.

    python bench/flash_emulation_check.py --device cuda
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers.flash_emulation import flash_attn_varlen_func  # noqa: E402  (the emulation under check)

BLOCK = 16
# (name, [(queries, keys held, keys used)] per request, query heads, key/value heads, left window): each a semantic
CASES = [
    ("causal, queries the last keys", [(37, 80, 80), (1, 33, 33), (64, 64, 64)], 4, 4, -1),
    ("grouped heads 8:2", [(20, 50, 50), (5, 17, 17)], 8, 2, -1),
    ("left window", [(40, 90, 90), (1, 70, 70)], 4, 2, 15),
    ("seqused_k below the keys held", [(10, 96, 41), (3, 64, 9)], 4, 2, -1),
    ("rows with no key (more queries than keys)", [(30, 96, 12), (4, 16, 0)], 4, 2, -1),
]


def case_tensors(requests, q_heads, kv_heads, device, dtype, seed):
    """Packed queries ``[T, Hq, D]``, packed keys and values ``[K, Hkv, D]`` (each request's keys held), and the same
    keys in a paged cache ``[blocks, BLOCK, Hkv, D]`` with its block table."""
    g = torch.Generator().manual_seed(seed)
    dim = 64
    q = torch.randn(sum(r[0] for r in requests), q_heads, dim, generator=g)
    k = torch.randn(sum(r[1] for r in requests), kv_heads, dim, generator=g)
    v = torch.randn(sum(r[1] for r in requests), kv_heads, dim, generator=g)
    blocks_per = [-(-held // BLOCK) for _, held, _ in requests]
    paged_k = torch.zeros(sum(blocks_per), BLOCK, kv_heads, dim)
    paged_v = torch.zeros_like(paged_k)
    table = torch.zeros(len(requests), max(blocks_per), dtype=torch.int32)
    first_key = first_block = 0
    for b, ((_, held, _), count) in enumerate(zip(requests, blocks_per, strict=True)):
        for j in range(held):
            paged_k[first_block + j // BLOCK, j % BLOCK] = k[first_key + j]
            paged_v[first_block + j // BLOCK, j % BLOCK] = v[first_key + j]
        table[b, :count] = torch.arange(first_block, first_block + count)
        first_key, first_block = first_key + held, first_block + count
    cast = [x.to(device, dtype) for x in (q, k, v, paged_k, paged_v)]
    return (*cast, table.to(device))


def emulated(requests, q, paged_k, paged_v, table, window, scale):
    cu_q = torch.tensor([0, *torch.tensor([r[0] for r in requests]).cumsum(0).tolist()])
    used = torch.tensor([r[2] for r in requests])
    out, lse = flash_attn_varlen_func(
        q.cpu(), paged_k.cpu(), paged_v.cpu(), max(r[0] for r in requests), cu_q, max(r[1] for r in requests),
        used, scale, True, (window, 0), table.cpu(), True,
    )  # fmt: skip
    return out.double(), lse.double()  # [T, Hq, D], [Hq, T]


def real(requests, q, k, v, window, scale):
    """PyTorch's FlashAttention-2, varlen: each request's keys packed, ``seqused_k`` limiting them."""
    device = q.device
    cu_q = torch.tensor([0, *torch.tensor([r[0] for r in requests]).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor([r[1] for r in requests]).cumsum(0).tolist()], dtype=torch.int32)
    used = torch.tensor([r[2] for r in requests], dtype=torch.int32, device=device)
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q.to(device), cu_k.to(device), max(r[0] for r in requests), max(r[1] for r in requests), 0.0,
        True, False, scale=scale, window_size_left=window, window_size_right=0, seqused_k=used,
    )  # fmt: skip
    if lse.dim() == 3:  # [B, Hq, max queries]: each request's rows, packed as the queries are
        lse = torch.cat([lse[b, :, : r[0]] for b, r in enumerate(requests)], dim=-1)
    return out.double().cpu(), lse.double().cpu()


def dense(requests, q, k, v, window, scale):
    """The same semantics as a dense float64 softmax per request (the CPU's stand-in for the kernel)."""
    outs, lses, first_q, first_k = [], [], 0, 0
    groups = q.shape[1] // k.shape[1]
    for queries, held, used in requests:
        rows = q[first_q : first_q + queries].double()
        keys = k[first_k : first_k + used].double().repeat_interleave(groups, 1)
        values = v[first_k : first_k + used].double().repeat_interleave(groups, 1)
        diagonal = torch.arange(queries)[:, None] + used - queries
        index = torch.arange(used)[None, :]
        allowed = (index <= diagonal) & ((index >= diagonal - window) if window >= 0 else True)
        scores = torch.einsum("thd,khd->htk", rows, keys) * scale
        scores = scores.masked_fill(~allowed, float("-inf"))
        lse = scores.logsumexp(-1)
        weights = torch.nan_to_num((scores - lse[..., None]).exp())
        outs.append(torch.einsum("htk,khd->thd", weights, values))
        lses.append(torch.where(lse.isinf(), float("inf"), lse))
        first_q, first_k = first_q + queries, first_k + held
    return torch.cat(outs), torch.cat(lses, dim=-1)


def largest(x: torch.Tensor) -> float:
    """The largest magnitude in ``x`` (0 for none)."""
    return x.abs().max().item() if x.numel() else 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("flash_emulation_check: no CUDA device here; --device cpu for the dry run")
        return 2
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    tolerance = 2e-2 if args.device == "cuda" else 1e-5  # bfloat16 inputs and the kernel's own rounding
    rows, failed = [], False
    for seed, (name, requests, q_heads, kv_heads, window) in enumerate(CASES):
        q, k, v, paged_k, paged_v, table = case_tensors(requests, q_heads, kv_heads, args.device, dtype, seed)
        scale = q.shape[-1] ** -0.5
        want_out, want_lse = emulated(requests, q, paged_k, paged_v, table, window, scale)
        check = real if args.device == "cuda" else dense
        got_out, got_lse = check(requests, q, k, v, window, scale)
        empty = want_lse.isinf()
        agree_empty = bool((got_lse.isinf() == empty).all()) and largest(got_out[empty.T]) == 0
        out_error, lse_error = largest(got_out - want_out), largest((got_lse - want_lse)[~empty])
        ok = out_error <= tolerance and lse_error <= tolerance and agree_empty
        failed |= not ok
        rows.append({"case": name, "out": out_error, "lse": lse_error, "empty rows agree": agree_empty, "ok": ok})
        print(f"{'ok  ' if ok else 'FAIL'} {name}: max |out| {out_error:.2e}, |lse| {lse_error:.2e}, "
              f"empty rows {'agree' if agree_empty else 'DIFFER'} ({int(empty.sum())} of {empty.numel()})")  # fmt: skip
    against = "PyTorch's FlashAttention-2 (bfloat16)" if args.device == "cuda" else "a dense float64 softmax"
    print(f"the emulation against {against}: {'every case agrees' if not failed else 'a case disagrees'}")
    out = Path(os.environ.get("OUT", "bench/out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "flash_emulation.json").write_text(json.dumps({"device": args.device, "cases": rows}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

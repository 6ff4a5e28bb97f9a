"""FlashAttention's paged varlen call and vLLM's merge, written out in float64 for the CPU: exactly the semantics
longreach.attention.paged_flash relies on (vllm_flash_attn's ``flash_attn_varlen_func`` docstring; vLLM's
``merge_attn_states``), so that the CUDA backend's algorithm is checked where no GPU runs vLLM. Tests only."""

import torch


def flash_attn_varlen_func(
    q,
    k,
    v,
    max_seqlen_q,
    cu_seqlens_q,
    max_seqlen_k,
    seqused_k,
    softmax_scale,
    causal,
    window_size,
    block_table,
    return_softmax_lse,
):
    """``q [T, Hq, D]``; ``k``, ``v`` ``[blocks, block size, Hkv, D]`` read through ``block_table [B, n]``, request
    ``b`` using its first ``seqused_k[b]`` keys. With ``causal``, the mask is aligned to the bottom right: query ``t``
    of ``Q`` reaches key ``j <= t + K - Q``; a window ``(left, right)`` keeps ``[t + K - Q - left, t + K - Q + right]``
    (-1: unbounded). Without, every query reaches every key (windows ``(-1, -1)``). Grouped heads: query head ``h``
    reads key/value head ``h // (Hq / Hkv)``. A row with no key is 0, its log-sum-exp +inf (FlashAttention 2's).
    Returns ``(out [T, Hq, D], lse [Hq, T] float32)``."""
    assert return_softmax_lse and seqused_k.shape[0] == cu_seqlens_q.shape[0] - 1
    tokens, q_heads, _ = q.shape
    block_size, kv_heads = k.shape[1], k.shape[2]
    out = torch.zeros(tokens, q_heads, v.shape[-1], dtype=torch.float64)
    lse = torch.full((q_heads, tokens), float("inf"), dtype=torch.float64)
    for b in range(len(seqused_k)):
        first, stop, keys = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]), int(seqused_k[b])
        assert stop - first <= max_seqlen_q and keys <= max_seqlen_k
        index = torch.arange(keys)
        blocks = block_table[b].long()[index // block_size]
        key = k[blocks, index % block_size].double().repeat_interleave(q_heads // kv_heads, dim=1)  # [K, Hq, D]
        value = v[blocks, index % block_size].double().repeat_interleave(q_heads // kv_heads, dim=1)
        rows = torch.arange(stop - first)[:, None] + keys - (stop - first)  # the diagonal's key per query
        allowed = index[None, :] <= rows + max(window_size[1], 0) if causal else torch.ones(1, keys, dtype=torch.bool)
        if window_size[0] >= 0:
            allowed &= index[None, :] >= rows - window_size[0]
        scores = torch.einsum("thd,khd->htk", q[first:stop].double(), key) * softmax_scale
        scores = scores.masked_fill(~allowed, float("-inf"))
        row_lse = scores.logsumexp(-1)  # [Hq, Q]
        weights = torch.nan_to_num((scores - row_lse[..., None]).exp())
        out[first:stop] = torch.einsum("htk,khd->thd", weights, value)
        lse[:, first:stop] = torch.where(row_lse.isinf(), float("inf"), row_lse)
    return out.to(q.dtype), lse.float()


def merge_attn_states(output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse=None):
    """vLLM's merge of two partial results (``lse [H, T]``, +inf or -inf: no key) by log-sum-exp, in place."""
    prefix_lse, suffix_lse = (torch.where(x.isinf(), float("-inf"), x.double()) for x in (prefix_lse, suffix_lse))
    top = torch.maximum(prefix_lse, suffix_lse)
    empty = top == float("-inf")
    top = torch.where(empty, 0.0, top)
    prefix_weight, suffix_weight = (prefix_lse - top).exp(), (suffix_lse - top).exp()
    total = prefix_weight + suffix_weight
    merged = (prefix_output.double() * (prefix_weight / total).T[..., None]) + (
        suffix_output.double() * (suffix_weight / total).T[..., None]
    )
    output.copy_(torch.nan_to_num(merged).to(output.dtype))
    if output_lse is not None:
        output_lse.copy_(torch.where(empty, float("-inf"), total.log() + top))

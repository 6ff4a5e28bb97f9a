"""vLLM's CPU attention backend, with longreach's kernel where the model's config records a method (:mod:`.vllm`).

vLLM hands a layer every request of a step at once: ``query [tokens, Hq, D]`` already rotated, requests delimited by
``query_start_loc``, request ``r`` holding ``seq_lens[r]`` tokens whose keys lie in the paged cache blocks of its
``block_table`` row; its queries are the last of those tokens (prefill, a chunk of a chunked prefill, a decoding step
or a prefix-cache hit alike), at positions ``seq_len - q_len + t``. With a method, this backend writes keys and values
into the cache in a plain ``[block, kv head, slot, D]`` layout (vLLM's CPU kernels may interleave theirs), reads each
request's keys back in order and calls :func:`longreach.attention.kernel.attention` with positions ``0 .. seq_len - 1``.

For correctness first: one call per request, its keys gathered from their blocks (a copy per layer and step). Without
a method, every call is vLLM's own.
"""

from __future__ import annotations

import torch
from vllm.config import get_current_vllm_config
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from ..attention import kernel
from .vllm import inverse_frequencies, method_of


class LongreachCPUImpl(CPUAttentionBackendImpl):
    """vLLM's CPU attention, or a longreach method's when the model's config records one."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        hf_config = get_current_vllm_config().model_config.hf_config
        self.method = method_of(hf_config) if self.attn_type == AttentionType.DECODER else None
        if self.method is not None:
            self.parts = self.method.parts()
            self.inv_freq = inverse_frequencies(hf_config, self.head_size)

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        """Keys and values into their slots (``slot_mapping``; -1: a padding token), in the plain layout."""
        if self.method is None:
            return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        key_cache, value_cache = _planes(kv_cache)
        block_size = key_cache.shape[2]
        slots = slot_mapping[: key.shape[0]].to(torch.int64)
        written = slots >= 0
        slots = slots[written]
        blocks, offsets = slots // block_size, slots % block_size
        key_cache[blocks, :, offsets] = key[: len(written)][written].to(key_cache.dtype)
        value_cache[blocks, :, offsets] = value[: len(written)][written].to(value_cache.dtype)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None, **kwargs):
        """Each request's attention by longreach's kernel over its keys in order (vLLM's own without a method, or in
        the profiling run, which has no metadata)."""
        if self.method is None or attn_metadata is None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale, **kwargs)
        key_cache, value_cache = _planes(kv_cache)
        block_size = key_cache.shape[2]
        window = None if self.sliding_window in (None, -1) else int(self.sliding_window)
        starts = attn_metadata.query_start_loc.tolist()
        for request, seq_len in enumerate(attn_metadata.seq_lens.tolist()):
            first, stop = starts[request], starts[request + 1]
            if stop <= first or seq_len == 0:
                continue
            blocks = attn_metadata.block_table[request, : -(-seq_len // block_size)].to(torch.int64)
            k, v = (_in_order(cache, blocks, seq_len) for cache in (key_cache, value_cache))  # [Hkv, seq_len, D]
            out = kernel.attention(
                query[first:stop].transpose(0, 1)[None],  # [1, Hq, q_len, D]
                k[None],
                v[None],
                self.parts,
                self.inv_freq,
                scaling=self.scale,
                sliding_window=window,
                positions=torch.arange(seq_len)[None],  # text models: a token's index is its RoPE position
            )
            output[first:stop] = out[0].to(output.dtype)  # [q_len, Hq, D]
        return output


def _planes(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's CPU cache ``[blocks, kv heads, block size, ...]`` as its key and value planes ``[blocks, Hkv, slot,
    D]``."""
    blocks, kv_heads, block_size, _ = kv_cache.shape
    return kv_cache.view(blocks, kv_heads, 2 * block_size, -1).chunk(2, dim=2)


def _in_order(cache: torch.Tensor, blocks: torch.Tensor, seq_len: int) -> torch.Tensor:
    """A request's ``seq_len`` keys (or values) from its blocks, in order: ``[Hkv, seq_len, D]``."""
    kv_heads, head_size = cache.shape[1], cache.shape[3]
    return cache[blocks].transpose(0, 1).reshape(kv_heads, -1, head_size)[:, :seq_len]


class LongreachCPUBackend(CPUAttentionBackend):
    """vLLM's CPU backend, whose implementation runs a longreach method where the model's config records one."""

    @staticmethod
    def get_impl_cls():
        return LongreachCPUImpl

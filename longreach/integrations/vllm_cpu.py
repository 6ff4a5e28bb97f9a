"""vLLM's CPU attention backend, with longreach's kernel where the model's config records a method (:mod:`.vllm`).

vLLM hands a layer every request of a step at once (:mod:`longreach.attention.paged` says how they are laid out).
With a method, this backend writes keys and values into the cache in a plain ``[block, kv head, slot, D]`` layout
(vLLM's CPU kernels may interleave theirs), and one call of longreach's CPU kernel computes every request's attention,
reading the keys through the block table and turning the keys a part moves as it reads them. What a call needs from
the step's requests alone (positions, the moved queries' angles, key spans, the kernel's tables) is laid out once per
step and shared by the layers. Without a method, every call is vLLM's own.
"""

from __future__ import annotations

import torch
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from ..attention.paged import KeyAngles, Step, attend, step_layout
from .vllm import layer_method

# per layer signature (:class:`.vllm.LayerMethod`), the step in progress: its metadata and layout, shared by its layers
STEPS: dict[str, tuple[object, Step]] = {}


class LongreachCPUImpl(CPUAttentionBackendImpl):
    """vLLM's CPU attention, or a longreach method's when the model's config records one."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        window = None if self.sliding_window in (None, -1) else int(self.sliding_window)
        self.layer = layer_method(self, window)
        if self.layer is not None:
            self.key_angles = KeyAngles(self.layer.inv_freq)

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        """Keys and values into their slots (``slot_mapping``; -1: a padding token), in the plain layout."""
        if self.layer is None:
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
        """Every request's attention by one call of longreach's kernel on the paged cache (vLLM's own without a
        method, or in the profiling run, which has no metadata)."""
        if self.layer is None or attn_metadata is None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale, **kwargs)
        key_cache, value_cache = _planes(kv_cache)
        tokens = attn_metadata.num_actual_tokens
        output[:tokens] = attend(query[:tokens], key_cache, value_cache, self._step(attn_metadata), self.scale).to(
            output.dtype
        )
        return output

    def _step(self, attn_metadata) -> Step:
        """The step's layout, built by the first layer of a step that computes alike and reused by the others (vLLM
        hands every layer of a step the same metadata object; the last one is held, so its identity is not reused)."""
        held = STEPS.get(self.layer.signature)
        if held is None or held[0] is not attn_metadata:
            requests = len(attn_metadata.query_start_loc) - 1
            step = step_layout(
                attn_metadata.block_table[:requests],
                attn_metadata.query_start_loc,
                attn_metadata.seq_lens[:requests],
                attn_metadata.num_actual_tokens,
                self.layer.cells,
                self.layer.inv_freq,
                self.key_angles,
            )
            held = STEPS[self.layer.signature] = (attn_metadata, step)
        return held[1]


def _planes(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's CPU cache ``[blocks, kv heads, block size, ...]`` as its key and value planes ``[blocks, Hkv, slot,
    D]``."""
    blocks, kv_heads, block_size, _ = kv_cache.shape
    return kv_cache.view(blocks, kv_heads, 2 * block_size, -1).chunk(2, dim=2)


class LongreachCPUBackend(CPUAttentionBackend):
    """vLLM's CPU backend, whose implementation runs a longreach method where the model's config records one."""

    @staticmethod
    def get_impl_cls():
        return LongreachCPUImpl

"""vLLM's CUDA attention backend (FlashAttention), with longreach's method where the model's config records one.

**Not run on a GPU yet** (no GPU machine here has vLLM): its algorithm, :func:`longreach.attention.paged_flash.
flash_cells`, is checked on the CPU against the float64 reference through an emulation of the two vLLM functions it
calls (``tests/helpers/flash_emulation.py``). Per layer and step: one ``flash_attn_varlen_func`` call per cell of the
method on the paged cache (STRING: two), merged by ``merge_attn_states``, with no host sync, so that vLLM's CUDA graphs
can capture it. Keys a part moves by a per-token shift (ReRoPE, Self-Extend, DCA, DPE) are written moved, once, into a
plane per shift that this backend keeps beside vLLM's cache: as large as the layer's key cache, memory vLLM's block
manager does not count (one warning says how much). DCA, whose key spans are chunks, is three calls over each
request's queries cut at chunk edges (:func:`longreach.attention.paged_flash.flash_dual_chunk`), where its chunk is
whole blocks. Without a method, every call is vLLM's own.
"""

from __future__ import annotations

import functools
import warnings

import torch
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend, FlashAttentionImpl
from vllm.v1.attention.ops.merge_attn_states import merge_attn_states

from ..attention.cells import key_views
from ..attention.paged import token_positions
from ..attention.paged_flash import Requests, flash_cells, flash_dual_chunk, spans_problem, write_moved_keys
from ..methods.dca import DualChunk
from .vllm import records_a_method
from .vllm_layer import ReadsLayout, layer_method


class LongreachFlashAttentionImpl(ReadsLayout, FlashAttentionImpl):
    """vLLM's FlashAttention, or a longreach method's calls of it when the model's config records one and the layer
    rotates."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        left = self.sliding_window[0]  # FlashAttention's (window - 1, 0), or (-1, -1)
        self.layer = layer_method(self, None if left < 0 else left + 1, _problem)
        self.planes: list[torch.Tensor] | None = None
        if self.layer is not None and self.kv_sharing_target_layer_name and key_views(self.layer.cells)[0]:
            raise ValueError(
                f"{self.layer.method.name} on {type(self).__name__}: a layer that reads another layer's KV cache "
                f"({self.kv_sharing_target_layer_name}; Gemma 4's num_kv_shared_layers) has no moved keys of its own "
                "here yet; STRING runs, and the CPU backend runs every method"
            )

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        """vLLM's writer, with the keys in the kernels' order where the layer runs a method
        (:class:`.vllm_layer.ReadsLayout`)."""
        if self.method_in(layer) is not None:
            key = self.in_kernel_order(key)
        return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None, **kwargs):
        """The method's calls (vLLM's own without a method or RoPE in the layer, or in the profiling run, which has no
        metadata)."""
        if attn_metadata is None or self.method_in(layer) is None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale, **kwargs)
        if output_scale is not None or kwargs.get("output_block_scale") is not None:
            raise NotImplementedError("longreach's methods on vLLM's CUDA backend: no fused output quantization")
        key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)  # [blocks, slot, Hkv, D]
        tokens = attn_metadata.num_actual_tokens
        planes = self._planes(key_cache)
        if planes:
            positions = token_positions(attn_metadata.query_start_loc, attn_metadata.seq_lens, tokens)
            write_moved_keys(
                planes,
                self.in_kernel_order(key[:tokens]),
                attn_metadata.slot_mapping[:tokens],
                self.layer.cells,
                positions,
                self.layer.inv_freq,
            )
        moved = [plane[:-1].view(key_cache.shape) for plane in planes]
        requests = Requests(
            attn_metadata.block_table,
            attn_metadata.query_start_loc,
            attn_metadata.seq_lens,
            attn_metadata.max_query_len,
            attn_metadata.max_seq_len,
        )
        query = self.in_kernel_order(query[:tokens])
        query = self.layer.scaled(query, attn_metadata.query_start_loc, attn_metadata.seq_lens)
        query = query.to(output.dtype)
        varlen = functools.partial(_flash_attn_varlen_func(), fa_version=self.vllm_flash_attn_version)
        last = (self.layer.inv_freq, self.scale, varlen, merge_attn_states, output[:tokens])
        method = self.layer.method
        if isinstance(method, DualChunk):  # three calls over pieces cut at chunk edges, on its plane of keys
            flash_dual_chunk(query, key_cache, value_cache, moved[0], requests, method.parts(), method.chunk, *last)
        else:
            flash_cells(query, key_cache, value_cache, moved, requests, self.layer.cells, *last)
        return output

    def _planes(self, key_cache: torch.Tensor) -> list[torch.Tensor]:
        """The planes of moved keys ``[slots + 1, Hkv, D]``, one per per-token key shift, made on first use, which may
        be inside a CUDA graph's capture (vLLM's warm-up runs before it are optional): made empty, so that nothing but
        the allocation happens there and no replay clears them. No slot is read before the layer writes it, as no key
        of vLLM's cache is."""
        if self.planes is None:
            blocks, block_size, kv_heads, dim = key_cache.shape
            shape = (blocks * block_size + 1, kv_heads, dim)
            self.planes = [key_cache.new_empty(shape) for _ in key_views(self.layer.cells)[0]]
            if self.planes:
                size = sum(plane.numel() * plane.element_size() for plane in self.planes) / 2**20
                warnings.warn(
                    f"longreach: {self.layer.method.name} keeps moved keys beside vLLM's cache, {size:.0f} MiB per "
                    "layer that vLLM's memory budget does not count; lower gpu_memory_utilization by as much",
                    stacklevel=2,
                )
        return self.planes


def _problem(cells, method) -> str | None:
    """Why FlashAttention's calls cannot run ``method``'s ``cells`` with this engine's block size, or ``None``."""
    from vllm.config import get_current_vllm_config

    chunk = method.chunk if isinstance(method, DualChunk) else None
    return spans_problem(cells, chunk, get_current_vllm_config().cache_config.block_size)


def _flash_attn_varlen_func():
    from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func  # CUDA builds only

    return flash_attn_varlen_func


class LongreachFlashAttentionBackend(FlashAttentionBackend):
    """vLLM's FlashAttention backend, whose implementation runs a longreach method where the model's config records
    one: vLLM's own class for a model without a record. Never without the keys and values (vLLM 0.33's
    ``supports_kv_cache_update_bypass``, by which a fused kernel writes the cache itself and ``forward`` is called
    without them): the keys a method moves are written from ``forward``'s ``key``, in the layer's layout."""

    supports_kv_cache_update_bypass = False

    @staticmethod
    def get_impl_cls():
        return LongreachFlashAttentionImpl if records_a_method() else FlashAttentionImpl

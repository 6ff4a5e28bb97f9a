"""vLLM's CPU attention backend, with longreach's kernel where the model's config records a method (:mod:`.vllm`).

vLLM hands a layer every request of a step at once (:mod:`longreach.attention.paged` says how they are laid out).
With a method, one call of longreach's CPU kernel computes every request's attention, reading the keys through the
block table and turning the keys a part moves as it reads them. The cache keeps vLLM's layout where the kernel reads
it: with vLLM's "vec" kernels (on x86: float32 and float16, and bfloat16 without AMX) each block's keys are stored
transposed and its values plain, and vLLM's own writer fills it. Its other layouts (AMX's for bfloat16, Arm's, ...)
interleave keys or values, so there this backend writes both in the plain ``[block, kv head, slot, D]`` layout. What a
call needs from the step's requests alone (positions, the moved queries' angles, key spans, the kernel's tables) is
laid out once per step and shared by the layers. Without a method, every call is vLLM's own.

The kernel is built in vLLM's main process (:func:`.vllm.prepare`), never here: a worker that finds none runs the
method by longreach's tiled kernel, request by request (:func:`longreach.attention.paged.attend_by_request`), with one
warning.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, fields

import torch
from vllm.distributed import get_tensor_model_parallel_rank
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)

from ..attention.native import prebuilt
from ..attention.paged import KeyAngles, Step, attend, attend_by_request, step_layout
from .vllm import records_a_method
from .vllm_layer import ReadsLayout, layer_method

# per layer signature (:class:`.vllm.LayerMethod`) and key layout, the step in progress: its metadata and layout
STEPS: dict[tuple[str, bool], tuple[object, Step]] = {}
# vLLM's CPU kernels whose cache layout the kernel reads: keys transposed per block, values plain
TRANSPOSED_KEYS = ("vec", "vec16")
NO_KERNEL: list[bool] = []  # whether this process found no kernel (and said so): it runs the tiled path from then


class LongreachCPUImpl(ReadsLayout, CPUAttentionBackendImpl):
    """vLLM's CPU attention, or a longreach method's when the model's config records one and the layer rotates."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        window = None if self.sliding_window in (None, -1) else int(self.sliding_window)
        self.layer = layer_method(self, window)
        self.tiled: tuple | None = None  # this layer's parts and whether it drops, where the kernel cannot run it
        self.seen = False  # whether a forward pass has read the layer's name (``tiled``)
        if self.layer is not None:
            self.key_angles = KeyAngles(self.layer.inv_freq)

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        """Keys and values into their slots (``slot_mapping``; -1: a padding token): by vLLM where the kernel reads its
        layout, else in the plain layout; the keys in the kernels' order (:class:`.vllm_layer.ReadsLayout`)."""
        if self.method_in(layer) is None:
            return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        key = self.in_kernel_order(key)
        if layer.isa in TRANSPOSED_KEYS:
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
        method or RoPE in the layer, or in the profiling run, which has no metadata)."""
        if attn_metadata is None or self.method_in(layer) is None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale, **kwargs)
        transposed = layer.isa in TRANSPOSED_KEYS
        key_cache, value_cache = _planes(kv_cache, transposed)
        tokens = attn_metadata.num_actual_tokens
        query = self.in_kernel_order(query[:tokens])
        query = self.layer.scaled(query, attn_metadata.query_start_loc, attn_metadata.seq_lens)
        if not self.seen:
            self.tiled, self.seen = self._tiled(layer.layer_name), True
        kernel = None if self.tiled or NO_KERNEL else prebuilt()  # never built here: see .vllm.prepare
        if kernel is None:
            if not self.tiled:
                self._warn_no_kernel()
            parts, drops = self.tiled or (self.layer.method.parts(), False)
            rates = None
            if drops:
                prefilling = getattr(attn_metadata, "is_prefilling", None)
                rates = self.layer.drop_rates(attn_metadata.query_start_loc, attn_metadata.seq_lens, prefilling, tokens)
            output[:tokens] = self._by_request(query, key_cache, value_cache, attn_metadata, transposed, parts, rates)
            return output
        step = self._step(attn_metadata, transposed)
        attended = attend(query, key_cache, value_cache, step, self.scale, kernel=kernel)
        output[:tokens] = attended.to(output.dtype)
        return output

    def _tiled(self, layer_name: str) -> tuple | None:
        """``(parts, drops)`` where the C++ kernel cannot compute this layer's calls, which the tiled path then computes
        request by request: DPE's pairs selected per layer and head (this rank's heads), or a layer where a drop method
        drops; ``None`` where it can."""
        drops = self.layer.drops_in(layer_name)
        if self.layer.cells is not None and not drops:
            return None
        if self.layer.cells is not None:
            return self.layer.method.parts(), drops
        first = get_tensor_model_parallel_rank() * self.num_heads  # this rank's query heads
        return self.layer.parts_of(layer_name, slice(first, first + self.num_heads)), drops

    @staticmethod
    def _warn_no_kernel() -> None:
        """One warning per process that finds no built kernel, which then runs the tiled path."""
        if not NO_KERNEL:
            NO_KERNEL.append(True)
            warnings.warn(
                "longreach: vLLM's worker finds no CPU attention kernel built for this environment, and never builds "
                "one; it runs the method by the tiled path (slower, the same results). Build it before vLLM starts: "
                "longreach.integrations.vllm.prepare() (it needs a C++ compiler)",
                stacklevel=4,
            )

    def _by_request(self, query, key_cache, value_cache, attn_metadata, transposed: bool, parts, rates=None):
        """The tiled path with ``parts`` (and each query's drop rate, ``rates [T]``), request by request: where this
        process finds no built kernel, or the kernel cannot compute the layer's calls."""
        requests = len(attn_metadata.query_start_loc) - 1
        return attend_by_request(
            query,
            key_cache,
            value_cache,
            attn_metadata.block_table[:requests],
            attn_metadata.query_start_loc,
            attn_metadata.seq_lens[:requests],
            parts,
            self.layer.inv_freq,
            self.scale,
            self.layer.window,
            transposed,
            rates,
        ).to(query.dtype)

    def _step(self, attn_metadata, keys_transposed: bool) -> Step:
        """The step's layout, built by the first layer of a step that computes alike and reused by the others (vLLM
        hands every layer of a step the same metadata object; the last one is held, so its identity is not reused)."""
        held = STEPS.get((self.layer.signature, keys_transposed))
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
                keys_transposed=keys_transposed,
            )
            held = STEPS[self.layer.signature, keys_transposed] = (attn_metadata, step)
        return held[1]


def _planes(kv_cache: torch.Tensor, keys_transposed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's CPU cache ``[blocks, kv heads, block size, ...]`` as its key and value planes ``[blocks, Hkv, slot,
    D]``, the key plane ``[blocks, Hkv, D, slot]`` where its keys are transposed."""
    blocks, kv_heads, block_size, _ = kv_cache.shape
    key_cache, value_cache = kv_cache.view(blocks, kv_heads, 2 * block_size, -1).chunk(2, dim=2)
    if keys_transposed:
        key_cache = key_cache.view(blocks, kv_heads, -1, block_size)
    return key_cache, value_cache


@dataclass
class LongreachCPUMetadata(CPUAttentionMetadata):
    """vLLM's CPU attention metadata and whether each request still reads its prompt (``[B]``, vLLM's common metadata
    has it): Dynamic Drop Attention gives the tokens generated after it a rate of their own."""

    is_prefilling: torch.Tensor | None = None


class LongreachCPUMetadataBuilder(CPUAttentionMetadataBuilder):
    """vLLM's CPU metadata builder, whose metadata also holds ``is_prefilling``."""

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False) -> LongreachCPUMetadata:
        built = super().build(common_prefix_len, common_attn_metadata, fast_build)
        held = {field.name: getattr(built, field.name) for field in fields(built)}
        return LongreachCPUMetadata(**held, is_prefilling=common_attn_metadata.is_prefilling)


class LongreachCPUBackend(CPUAttentionBackend):
    """vLLM's CPU backend, whose implementation runs a longreach method where the model's config records one: vLLM's own
    classes for a model without a record."""

    @staticmethod
    def get_impl_cls():
        return LongreachCPUImpl if records_a_method() else CPUAttentionBackendImpl

    @staticmethod
    def get_builder_cls():
        return LongreachCPUMetadataBuilder if records_a_method() else CPUAttentionMetadataBuilder

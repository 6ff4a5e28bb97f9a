"""What one of longreach's vLLM backends runs in an attention layer (:mod:`.vllm_cpu`, :mod:`.vllm_cuda`): the method
the engine's model config records (:func:`.vllm.methods_of`), its cells for the layer's window, the rotary
frequencies vLLM's own rotary embedding turned the layer's queries and keys by, and the layer's rotary layout; or why
the engine cannot run it.

The layouts are read as :func:`longreach.apply` reads them (:func:`.families.read_layouts`), from an empty model that
transformers builds from the engine's config on the meta device: which layers rotate at all, their pairs (half or
interleaved) and their rotated dimensions. A layer without RoPE runs vLLM's own attention under every method; the
queries and keys of a layer whose pairs are not the kernels' are permuted into the kernels' order
(:func:`.layout.to_kernel`) as they are written to the cache and attended: a permutation of a head's dimensions applied
to both leaves every dot product, and so the attention, as it was. tests/test_vllm.py holds vLLM's implementation of
each layout equal to transformers'.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..attention.cells import Cell, lower
from ..attention.layout import Layout, layer_ranges, to_kernel
from ..attention.paged import per_token, scaled_queries, token_positions
from ..methods.base import Part, PositionMethod
from ..methods.drop import Drop, DynamicDrop
from .families import config_layouts
from .transformers import CONFIG_KEY
from .vllm import LAYER_TYPES, layer_ropes, methods_of, model_problem


def engine_problem(vllm_config, kv_cache_dtype: str) -> str | None:
    """Why an engine cannot run a longreach method (one line), or ``None``."""
    if str(kv_cache_dtype).startswith("fp8"):
        return f"kv_cache_dtype={kv_cache_dtype!r}: longreach's methods read an unquantised KV cache; use 'auto'"
    parallel = vllm_config.parallel_config
    for name in ("prefill_context_parallel_size", "decode_context_parallel_size"):
        if getattr(parallel, name, 1) > 1:
            return f"{name}={getattr(parallel, name)}: context parallelism does not run longreach methods yet; use 1"
    return None


@dataclass(frozen=True)
class LayerMethod:
    """What a backend's attention layer runs: the method, its cells for the layer's sliding ``window``
    (:func:`.cells.lower`; ``None``: none; the cells ``None`` where the parts differ by layer and head, DPE's selected
    pairs: :meth:`parts_of`), and the rotary frequencies ``[P]``."""

    method: PositionMethod
    cells: tuple[Cell, ...] | None
    inv_freq: torch.Tensor
    signature: str  # equal for the layers whose record, window and head size are equal: they compute alike
    window: int | None
    layouts: dict[int, Layout]  # the model's, by layer index
    drop: Drop | DynamicDrop | None = None  # a drop method composed with it, in the layers it names

    def layout_in(self, layer_name: str) -> Layout:
        """The rotary layout of the model's layer ``layer_name`` (vLLM's ``model.layers.<index>...``); a one-line
        ``ValueError`` where the model has none for it, or its rotated dimensions are not those vLLM's rotary
        embedding turns (:attr:`inv_freq`)."""
        from vllm.model_executor.models.utils import extract_layer_index

        index = extract_layer_index(layer_name)
        layout = self.layouts.get(index)
        if layout is None:
            raise ValueError(f"{layer_name}: the model's config describes no attention layer {index} to read")
        if layout.rotated and layout.dims != 2 * self.inv_freq.shape[-1]:
            raise ValueError(
                f"{layer_name}: transformers rotates {layout.dims} dimensions, vLLM's rotary embedding "
                f"{2 * self.inv_freq.shape[-1]}; longreach cannot tell which to move"
            )
        return layout

    def drops_in(self, layer_name: str) -> bool:
        """Whether the drop method drops in the model's layer ``layer_name``."""
        from vllm.model_executor.models.utils import extract_layer_index

        return self.drop is not None and extract_layer_index(layer_name) in self.drop.layers

    def drop_rates(self, query_start: torch.Tensor, seq_lens: torch.Tensor, prefilling, tokens: int) -> torch.Tensor:
        """Each query's drop rate ``[T]`` (:meth:`.drop.Drop.rates`): at its position, generated where its request no
        longer reads its prompt (``prefilling [B]``, vLLM's ``is_prefilling``; ``None``: every query is prompt)."""
        positions = token_positions(query_start, seq_lens, tokens)[None]
        generated = None
        if prefilling is not None:
            generated = per_token(~prefilling[: len(query_start) - 1].bool(), query_start, tokens)[None]
        assert self.drop is not None  # asked in the layers it drops_in
        return self.drop.rates(positions, self.method.training_window, generated)[0]

    def scaled(self, query: torch.Tensor, query_start: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """The step's queries ``[T, Hq, D]`` with the method's logit factor in their rotary dimensions
        (:func:`.paged.scaled_queries`; STRING's and DCA's ``mscale``), for the requests' lengths so far: vLLM's
        attention is not told a prompt's whole length, so a prompt read in chunks takes each chunk's."""
        requests = len(query_start) - 1
        factor = self.method.logit_scale_at(seq_lens[:requests])
        return scaled_queries(query, factor, query_start, 2 * self.inv_freq.shape[-1])

    def parts_of(self, layer_name: str, heads: slice) -> tuple[Part, ...]:
        """The method's parts in the model's layer ``layer_name`` (vLLM's ``model.layers.<index>...``) for the query
        heads ``heads`` of the model's (a tensor-parallel rank holds a slice of them): DPE's pairs selected for
        that layer and those heads."""
        from vllm.model_executor.models.utils import extract_layer_index

        parts = self.method.layer_parts(extract_layer_index(layer_name))
        return tuple(part if part.pairs is None else replace(part, pairs=part.pairs[heads]) for part in parts)


# a backend's: why it cannot run a method's cells
CellsProblem = Callable[[tuple[Cell, ...], PositionMethod], "str | None"]


def layer_method(impl, window: int | None, problem_of: CellsProblem | None = None):
    """The method the engine's model config records, for the backend layer ``impl`` (vLLM's attention implementation:
    its ``attn_type``, ``kv_cache_dtype``, ``head_size``) with sliding ``window`` (``None``: none); ``None`` where
    the layer runs as in stock vLLM (no record, a frequency method, or not a decoder layer). A one-line ``ValueError``
    where the engine, or the backend's ``problem_of`` the cells and the method, cannot run it."""
    from vllm.config import get_current_vllm_config

    vllm_config = get_current_vllm_config()
    hf_config = vllm_config.model_config.hf_config
    recorded = methods_of(hf_config) if impl.attn_type == "decoder" else None
    if recorded is None:
        return None
    method, drop = recorded
    cells = None if method.parts_differ_by_layer else lower(method.parts(), window)
    problem = engine_problem(vllm_config, impl.kv_cache_dtype)
    if not problem and getattr(impl, "logits_soft_cap", None):  # Gemma 2's attn_logit_softcapping
        problem = f"logits_soft_cap={impl.logits_soft_cap}: capped attention logits do not run longreach methods yet"
    cells_problem = None
    if not problem and problem_of is not None:
        if cells is None:
            cells_problem = "its pairs selected per layer and head (dimensions=) do not run here yet"
        elif drop is not None:
            cells_problem = (
                f"{drop.name} drops scores per query, which this backend does not do yet; the CPU backend does"
            )
        else:
            cells_problem = problem_of(cells, method)
    if cells_problem:
        problem = f"{method.name} on {type(impl).__name__}: {cells_problem}"
    if problem:
        raise ValueError(problem)
    record = json.dumps(getattr(hf_config, CONFIG_KEY), sort_keys=True, default=str)
    signature = f"{record} window={window} head_size={impl.head_size}"
    inv_freq = inverse_frequencies(hf_config, impl.head_size, window)
    layouts = config_layouts(hf_config)
    if record not in ANNOUNCED:
        ANNOUNCED.add(record)
        announce(method, drop, layouts)
    return LayerMethod(method, cells, inv_freq, signature, window, layouts, drop)


ANNOUNCED: set[str] = set()  # the records this process has said it runs


def announce(method: PositionMethod, drop: Drop | DynamicDrop | None, layouts: dict[int, Layout]) -> None:
    """One line in vLLM's log, once per process and record: the method with every parameter, and the layers by
    layout (those without RoPE run vLLM's own attention), e.g. ``longreach runs string(shift=5461, local_window=128,
    mscale=False) [L=8192]; layers 0-29 (30): RoPE, half pairs, dims 0-63 of 64``."""
    from vllm.logger import init_logger

    by_layout: dict[str, list[int]] = {}
    for index, layout in sorted(layouts.items()):
        by_layout.setdefault(layout.describe(), []).append(index)
    runs_vllms = {"no RoPE": ", vLLM's own"}  # what such layers run
    layers = "; ".join(
        f"layers {layer_ranges(indices)} ({len(indices)}): {described}{runs_vllms.get(described, '')}"
        for described, indices in by_layout.items()
    )
    methods = " + ".join(x.describe() for x in (method, drop) if x is not None)
    init_logger("vllm.longreach").info("longreach runs %s [L=%d]; %s", methods, method.training_window, layers)


class ReadsLayout:
    """What both backends' implementations do with a layer's layout: read it on the layer's first call (vLLM names
    the layer only then), and from then on run a layer without RoPE as vLLM's own, and put the queries and keys of
    the others in the kernels' order."""

    layer: Any  # the LayerMethod, or None (typed loosely: the implementations narrow it once per call)
    layout: Layout | None = None

    def method_in(self, layer) -> LayerMethod | None:
        """The method this layer runs (``layer``: vLLM's ``Attention`` module), or None where it runs as vLLM's own:
        without a record, or a layer without RoPE."""
        if self.layer is not None and self.layout is None:
            self.layout = self.layer.layout_in(layer.layer_name)
            if not self.layout.rotated:
                self.layer = None
        return self.layer

    def in_kernel_order(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor [tokens, heads, D]`` (queries or keys) with its dimensions in the kernels' order."""
        assert self.layout is not None  # read by method_in first
        return to_kernel(self.layout, tensor)[0]


def inverse_frequencies(hf_config, head_size: int, window: int | None = None) -> torch.Tensor:
    """The rotary pairs' frequencies ``[P]`` (float32) that vLLM's rotary embedding turns the layer's queries and keys
    by, read from that embedding: ``get_rope`` with the model's ``rope_parameters`` (for a model with a RoPE per layer
    type, the sliding-window layers' where the layer has a ``window``, else the full layers'), as the model's layers
    call it (it hands back the layers' own object). Su et al. 2021, Eq. 15, ``theta_k = base^(-2k / d)`` over the
    rotary dimensions ``d``, as the model's own scaling maps them: Llama 3's per-band factors and YaRN's blend of
    interpolated and extrapolated frequencies (its attention factor is in the vectors already, and stays there, as in
    transformers), LongRoPE's per-pair factors (Phi-3: vLLM 0.32 takes the long ones for every position where the
    engine's ``max_model_len`` passes ``original_max_position_embeddings``, else the short ones; transformers takes the
    long ones for a forward pass whose sequence passes it: the two agree past it), and linear scaling's positions
    divided by its factor, written as frequencies divided by it."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    problem = model_problem(text)
    if problem:
        raise ValueError(problem)
    from vllm.model_executor.layers.rotary_embedding import (
        LinearScalingRotaryEmbedding,
        Phi3LongRoPEScaledRotaryEmbedding,
        YaRNScalingRotaryEmbedding,
        get_rope,
    )

    ropes = layer_ropes(text)
    own = ropes[None] if None in ropes else ropes[LAYER_TYPES[window is not None]]
    rope = get_rope(head_size, max_position=int(text.max_position_embeddings), rope_parameters=own, is_neox_style=True)
    if isinstance(rope, YaRNScalingRotaryEmbedding):
        return rope._compute_inv_freq(rope.scaling_factor).float()
    if isinstance(rope, Phi3LongRoPEScaledRotaryEmbedding):  # the long factors for every position, or the short ones
        return rope._compute_inv_freq(rope.long_factor if rope.use_long_rope else rope.short_factor).float()
    inv_freq = rope._compute_inv_freq(rope.base).float()
    if isinstance(rope, LinearScalingRotaryEmbedding):
        (factor,) = rope.scaling_factors
        inv_freq = inv_freq / factor
    return inv_freq

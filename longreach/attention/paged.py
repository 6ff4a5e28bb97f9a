"""A method's attention for many sequences at once over a paged key/value cache (vLLM's), by the CPU kernel.

vLLM hands attention every request of a step together: queries ``[T, Hq, D]`` already rotated at their positions, the
requests delimited by ``query_start [B + 1]``, request ``b`` holding ``seq_lens[b]`` tokens whose keys and values lie
in the cache blocks of its ``block_table`` row; its queries are the last of those tokens (a prefill, a chunk of one, a
decoding step or a prefix-cache hit alike). A token's index in its sequence is its RoPE position (text models).

The kernel (``csrc/parts.cpp``, called by :mod:`.native`) reads the keys through the block table itself: no
per-request gather, no loop over requests. Keys a part moves by a per-token shift (ReRoPE, Self-Extend, DCA, DPE) are
turned as they are read, by an angle table per key index that :class:`KeyAngles` keeps (Su et al. 2021, Eq. 34: a key
at ``j`` moved by ``s(j)`` is the key turned by ``s(j) theta``).

The key cache is ``[blocks, Hkv, block size, D]``, or *transposed*, ``[blocks, Hkv, D, block size]``: vLLM's CPU
cache for its "vec" kernels, which its own writer fills, and whose key blocks the kernel multiplies in place.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from . import native
from .cells import Cell, key_views, query_views, view_angles
from .parts import Part
from .rotary import apply_rotation
from .shifts import shift_angles


class KeyAngles:
    """``(cos, sin) [N, P]`` float32 of each per-token key shift at key indices ``0 .. N - 1`` (``[P, N]`` for a
    transposed cache), kept and grown by doubling (a shift depends on the key's index alone, so the first ``N`` keys'
    angles never change)."""

    def __init__(self, inv_freq: torch.Tensor):
        self.inv_freq = inv_freq
        self.tables: dict[tuple[int, bool], tuple[torch.Tensor, torch.Tensor]] = {}

    def of(self, shift, keys: int, transposed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        table = self.tables.get((id(shift), transposed))
        if table is None or table[0].shape[-1 if transposed else 0] < keys:
            size = 1 << max(keys - 1, 1).bit_length()
            cos, sin = shift_angles(shift, torch.arange(size)[None], self.inv_freq, torch.float32)
            cos, sin = (x[0, 0].T if transposed else x[0, 0] for x in (cos, sin))
            table = self.tables[id(shift), transposed] = (cos.contiguous(), sin.contiguous())
        return table


def per_token(values: torch.Tensor, query_start: torch.Tensor, tokens: int) -> torch.Tensor:
    """A value per request ``[B]`` repeated for each of the request's query tokens: ``[tokens]``, without a host
    sync (requests delimited by ``query_start [B + 1]``). Tokens past the last request's (a CUDA graph's padding:
    vLLM pads a replayed batch's tokens beyond its requests') get 0."""
    padded = torch.cat([values, values.new_zeros(1)])
    return torch.repeat_interleave(padded, _query_lengths(query_start, tokens), output_size=tokens)


def token_positions(query_start: torch.Tensor, seq_lens: torch.Tensor, tokens: int) -> torch.Tensor:
    """Each query token's position ``[tokens]`` on the tensors' device, without a host sync: request ``b``'s ``t``-th
    query is at ``seq_lens[b] - q_len + t``; the tokens past the last request's (padding) at negative positions,
    which nothing reads."""
    q_lens = _query_lengths(query_start, tokens)
    request = torch.repeat_interleave(torch.arange(len(q_lens), device=q_lens.device), q_lens, output_size=tokens)
    index = torch.arange(tokens, device=q_lens.device)
    first = torch.cat([seq_lens, seq_lens.new_zeros(1)]) - q_lens
    return index - query_start[request] + first[request]


def _query_lengths(query_start: torch.Tensor, tokens: int) -> torch.Tensor:
    """Each request's query tokens ``[B + 1]``, and last, those of the ``tokens`` past the last request's: vLLM pads
    a batch that replays a CUDA graph with tokens that belong to no request (its ``num_actual_tokens`` counts them)."""
    rest = (tokens - query_start[-1:]).to(query_start.dtype)
    return torch.cat([query_start[1:] - query_start[:-1], rest])


def scaled_queries(
    query: torch.Tensor, factor: float | torch.Tensor, query_start: torch.Tensor, rotary_dims: int
) -> torch.Tensor:
    """The queries ``[T, Hq, D]`` with their rotary dimensions multiplied by their sequence's logit factor: a number,
    or one per request ``[B]`` (a method's :meth:`~longreach.methods.base.PositionMethod.logit_scale_at` of the
    requests' lengths), so that the rotary logits are multiplied by it, as the kernels' ``logit_scale`` does. The
    queries themselves where the factor is 1; a copy, float32 where it is a tensor, else; no host sync."""
    if not isinstance(factor, torch.Tensor) and factor == 1.0:
        return query
    if isinstance(factor, torch.Tensor):
        factor = per_token(factor.to(query.device, torch.float32), query_start, query.shape[0])[:, None, None]
    scaled = query.to(torch.float32, copy=True)
    scaled[..., :rotary_dims] *= factor
    return scaled


@dataclass(frozen=True)
class Step:
    """What a call takes that depends on the step's requests and the method, not on the layer, built once by
    :func:`step_layout` and shared by every layer of the step (vLLM hands them the same metadata)."""

    view_cos: torch.Tensor | None  # [V, 1, T, P] float32, the moved query views' angles (None: no view)
    view_sin: torch.Tensor | None
    key_cos: list[torch.Tensor]  # per key plane but the first: the angle table [N, P] its keys turn by, or empty
    key_sin: list[torch.Tensor]
    cell_table: torch.Tensor  # [cells, 5]: the cells as native.cell_table lays them out
    span_first: list[torch.Tensor]  # [T] key indices per span
    span_stop: list[torch.Tensor]
    sequences: torch.Tensor  # [B, 5]: q_start, q_len, offset, kv_len, first key
    block_table: torch.Tensor  # [B, blocks per request] int64
    keys_transposed: bool  # the key cache is [blocks, Hkv, D, block size]


def step_layout(
    block_table: torch.Tensor,
    query_start: torch.Tensor,
    seq_lens: torch.Tensor,
    tokens: int,
    cells: Sequence[Cell],
    inv_freq: torch.Tensor,
    key_angles: KeyAngles,
    keys_transposed: bool = False,
) -> Step:
    """The :class:`Step` of requests ``query_start``/``seq_lens`` (``tokens`` queries) under ``cells``; the keys a
    part moves are turned by :class:`KeyAngles` tables as read; ``keys_transposed``: the key cache the layers hand
    :func:`attend` is transposed."""
    positions = token_positions(query_start, seq_lens, tokens)[None]  # [1, T]
    views, view_of = query_views(cells)
    shifts, key_of = key_views(cells)
    view_cos = view_sin = None
    if views:
        cos, sin = view_angles(views, positions, inv_freq, torch.float32)  # [V, 1, 1, T, P]
        view_cos, view_sin = cos[:, 0], sin[:, 0]
    longest = int(seq_lens.max()) if len(seq_lens) else 1
    tables = [key_angles.of(shift, longest, keys_transposed) for shift in shifts]
    key_cos, key_sin = [table[0] for table in tables], [table[1] for table in tables]

    def key_indices(span: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """A request's key positions are its key indices: a span is clamped to the keys there are."""
        first, stop = [bound.clamp(0, longest).to(torch.int64)[0].contiguous() for bound in span]
        return first, stop

    table, span_first, span_stop = native.cell_table(cells, view_of, key_of, positions, key_indices)
    q_lens = query_start[1:] - query_start[:-1]
    sequences = torch.stack([query_start[:-1], q_lens, seq_lens - q_lens, seq_lens, torch.zeros_like(seq_lens)], dim=1)
    return Step(
        view_cos,
        view_sin,
        key_cos,
        key_sin,
        table,
        span_first,
        span_stop,
        sequences.to(torch.int64).contiguous(),
        block_table.to(torch.int64).contiguous(),
        keys_transposed,
    )


def attend(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    step: Step,
    scaling: float,
    kernel=None,
) -> torch.Tensor:
    """One layer's attention of a step laid out by :func:`step_layout`: ``[T, Hq, Dv]`` float32 (see
    :func:`paged_attention` for the arguments); ``kernel``: the C++ extension (default: built here if need be)."""
    tokens = query.shape[0]
    rows = query.transpose(0, 1).to(torch.float32).contiguous()  # [Hq, T, D]
    queries = [rows]
    if step.view_cos is not None and step.view_sin is not None:  # (both or neither)
        queries += [moved.contiguous() for moved in apply_rotation(rows[None], step.view_cos, step.view_sin)]
    none = torch.empty(0)
    planes = 1 + len(step.key_cos)  # the cache as it is, then once per key shift, turned as read
    out, _ = native.parts_attention(
        queries,
        [key_cache] * planes,
        [step.keys_transposed] * planes,
        [none, *step.key_cos],
        [none, *step.key_sin],
        value_cache,
        step.block_table,
        value_cache.shape[2],
        step.sequences,
        step.cell_table,
        step.span_first,
        step.span_stop,
        scaling,
        kernel,
    )
    return out.transpose(0, 1)[:tokens]


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start: torch.Tensor,
    seq_lens: torch.Tensor,
    cells: Sequence[Cell],
    inv_freq: torch.Tensor,
    scaling: float,
    key_angles: KeyAngles,
    keys_transposed: bool = False,
) -> torch.Tensor:
    """Every request's attention under ``cells`` (:func:`.cells.lower` of a method's parts): ``[T, Hq, Dv]`` float32;
    :func:`step_layout` then :func:`attend`, which a model's layers call with one layout per step.

    Args:
        query: ``[T, Hq, D]``, rotated at :func:`token_positions`.
        key_cache, value_cache: ``[blocks, Hkv, block size, D]``, dense per head (float32, bfloat16 or float16);
            the key cache ``[blocks, Hkv, D, block size]`` where ``keys_transposed``.
        block_table: ``[B, blocks per request]``; ``query_start [B + 1]``; ``seq_lens [B]`` (CPU tensors).
        inv_freq: the rotary frequencies ``[P]``; ``scaling``: the logits' scale.
        key_angles: the key shifts' angle tables, kept across calls.
    """
    step = step_layout(block_table, query_start, seq_lens, query.shape[0], cells, inv_freq, key_angles, keys_transposed)
    return attend(query, key_cache, value_cache, step, scaling)


def attend_by_request(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start: torch.Tensor,
    seq_lens: torch.Tensor,
    parts: Sequence[Part],
    inv_freq: torch.Tensor,
    scaling: float,
    window: int | None = None,
    keys_transposed: bool = False,
    drop: torch.Tensor | None = None,
) -> torch.Tensor:
    """What :func:`paged_attention` computes, ``[T, Hq, Dv]`` float32, by the tiled kernel (:func:`.kernel.attention`,
    backend ``cpu_flash``) one request at a time, its keys and values gathered from the cache: where the C++ kernel is
    not built (a vLLM worker never builds it), or cannot compute the call (DPE's pairs per head; Drop Attention,
    ``drop``: each query's rate ``[T]``). Slower, the same results; ``parts`` the method's (this layer's and these
    heads'), ``window`` the layer's sliding window."""
    from .kernel import attention

    tokens, block_size = query.shape[0], value_cache.shape[2]
    out = query.new_zeros(tokens, query.shape[1], value_cache.shape[-1], dtype=torch.float32)
    starts, lengths = query_start.tolist(), seq_lens.tolist()
    for request, length in enumerate(lengths):
        first, stop = starts[request], min(starts[request + 1], tokens)
        if stop <= first:
            continue
        blocks = block_table[request, : -(-length // block_size)].to(torch.int64)
        keys = key_cache[blocks].transpose(-1, -2) if keys_transposed else key_cache[blocks]  # [n, Hkv, slot, D]
        keys, values = (x.transpose(0, 1).flatten(1, 2)[None, :, :length].float() for x in (keys, value_cache[blocks]))
        rows = query[first:stop].transpose(0, 1)[None].float()  # [1, Hq, q_len, D]
        rates = None if drop is None else drop[first:stop][None]
        out[first:stop] = attention(
            rows, keys, values, parts, inv_freq, scaling=scaling, sliding_window=window, drop=rates, backend="cpu_flash"
        )[0]
    return out

"""A method's attention over vLLM's paged cache by FlashAttention: one ``flash_attn_varlen_func`` call per cell, the
calls merged by ``merge_attn_states`` (the two functions vLLM's CUDA backend calls, handed in).

A cell's pairs ``lo <= i - j < hi`` are one causal call: with ``seqused_k = max(seq_len - lo, 0)`` keys, the causal
mask aligned to the bottom right lets query ``i`` (key index ``i``) reach the keys ``j <= i - lo``, and the window
``(hi - 1 - lo, 0)`` cuts them at ``j > i - hi`` (FlashAttention's window: ``[i + K - Q - left, i + K - Q + right]``
for ``K`` keys and ``Q`` queries). STRING is thus two calls and one merge: the band with the window ``(S - 1, 0)``,
and the far part with the query turned by ``-(S - W)`` and ``seqused_k = max(seq_len - S, 0)`` (An et al. 2025, Eq.
3). A part that moves its query (Self-Extend's groups, ReRoPE's fixed far position) has its query turned here at
each token's position; a part that moves its keys by a per-token shift reads planes of moved keys the caller keeps
(:func:`write_moved_keys`). A row with no key comes back empty (FlashAttention's log-sum-exp +inf or -inf, both read
as empty by the merge). No host sync: CUDA graphs can capture it.

DCA's key spans are chunks, no distance bounds: :func:`flash_dual_chunk` cuts each request's queries at the chunk
edges, and makes three calls over those pieces with block tables that start at a chunk (a chunk is whole blocks).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .cells import Cell, key_views, lower, query_views, view_angles
from .paged import token_positions
from .parts import Part
from .rotary import apply_rotation
from .shifts import shift_angles


@dataclass(frozen=True)
class Requests:
    """What a step's calls read of vLLM's attention metadata: the block table ``[B, n]``, the queries' starts
    ``[B + 1]``, the sequences' lengths ``[B]`` (device tensors), the longest query and sequence (host numbers)."""

    block_table: torch.Tensor
    query_start: torch.Tensor
    seq_lens: torch.Tensor
    max_query_len: int
    max_seq_len: int


def spans_problem(cells: Sequence[Cell], chunk: int | None = None, block_size: int | None = None) -> str | None:
    """Why FlashAttention's calls cannot compute ``cells`` (one line), or ``None``: DCA's (its ``chunk``, ``c = s -
    l``, given) run by :func:`flash_dual_chunk` where a chunk is whole blocks of ``block_size`` keys and the layer has
    no window."""
    if chunk is not None and block_size is not None:
        if chunk % block_size:
            return (
                f"chunk_size - local_window = {chunk} is not a whole number of vLLM's blocks of {block_size} keys, "
                "which FlashAttention's calls read DCA's chunks by"
            )
        if len(cells) < 3 or any(cell.hi != cell.part.max_distance for cell in cells):
            return "DCA on a sliding-window layer: FlashAttention's calls do not run it yet"
        return None
    if any(not cell.by_distance_alone for cell in cells):
        return (
            "a part with key spans (DCA) or per-head rotary pairs is no distance bound: FlashAttention's calls cannot"
        )
    return None


def moved_queries(query: torch.Tensor, cells: Sequence[Cell], positions: torch.Tensor, inv_freq: torch.Tensor):
    """The query views the cells read, ``[query, *moved]`` (``[T, Hq, D]`` each), and each cell's index among them."""
    views, view_of = query_views(cells)
    if not views:
        return [query], view_of
    cos, sin = view_angles(views, positions[None], inv_freq.to(query.device), torch.float32)  # [V, 1, 1, T, P]
    moved = apply_rotation(query[None], cos[:, 0, 0, :, None], sin[:, 0, 0, :, None])  # [V, T, Hq, D]
    return [query, *moved], view_of


def write_moved_keys(
    planes: Sequence[torch.Tensor], key: torch.Tensor, slots: torch.Tensor, cells: Sequence[Cell], positions, inv_freq
) -> None:
    """The new tokens' keys ``key [T, Hkv, D]`` (rotated at ``positions [T]``), moved by each per-token key shift of
    the cells, written to their slots of that shift's plane ``[slots + 1, Hkv, D]`` (a slot of -1, a padding token,
    writes the last row, which no block holds)."""
    shifts, _ = key_views(cells)
    if not shifts:
        return
    rows = torch.where(slots < 0, planes[0].shape[0] - 1, slots)
    for plane, shift in zip(planes, shifts, strict=True):
        cos, sin = shift_angles(shift, positions[None], inv_freq.to(key.device), torch.float32)  # [1, 1, T, P]
        plane.index_copy_(0, rows, apply_rotation(key, cos[0, 0, :, None], sin[0, 0, :, None]).to(plane.dtype))


def flash_cells(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    moved_key_caches: Sequence[torch.Tensor],
    requests: Requests,
    cells: Sequence[Cell],
    inv_freq: torch.Tensor,
    scale: float,
    varlen: Callable,
    merge: Callable,
    output: torch.Tensor,
) -> torch.Tensor:
    """Every request's attention under ``cells``, written into ``output [T, Hq, D]``.

    Args:
        query: ``[T, Hq, D]``, rotated at :func:`token_positions`.
        key_cache, value_cache: ``[blocks, block size, Hkv, D]``, FlashAttention's paged layout.
        moved_key_caches: per key shift of :func:`.cells.key_views`, its plane of moved keys, laid out as
            ``key_cache``.
        requests: vLLM's attention metadata.
        varlen: ``flash_attn_varlen_func``; merge: ``merge_attn_states``.
    """
    query_start, seq_lens = requests.query_start, requests.seq_lens
    positions = token_positions(query_start, seq_lens, query.shape[0])
    queries, view_of = moved_queries(query, cells, positions, inv_freq)
    _, key_of = key_views(cells)
    results = []
    for cell, query_view, key_view in zip(cells, view_of, key_of, strict=True):
        results.append(
            varlen(
                q=queries[query_view],
                k=key_cache if key_view == 0 else moved_key_caches[key_view - 1],
                v=value_cache,
                max_seqlen_q=requests.max_query_len,
                cu_seqlens_q=query_start,
                max_seqlen_k=requests.max_seq_len,
                seqused_k=(seq_lens - cell.lo).clamp(min=0).to(seq_lens.dtype),
                softmax_scale=scale,
                causal=True,
                window_size=[-1 if cell.hi is None else cell.hi - 1 - cell.lo, 0],
                block_table=requests.block_table,
                return_softmax_lse=True,
            )
        )
    if len(results) == 1:
        output.copy_(results[0][0])
        return output
    out, lse = results[0]
    for index, (cell_out, cell_lse) in enumerate(results[1:], start=2):
        last = index == len(results)
        merged = output if last else torch.empty_like(cell_out)
        merged_lse = None if last else torch.empty_like(cell_lse)
        merge(merged, out, lse, cell_out, cell_lse, output_lse=merged_lse)
        out, lse = merged, merged_lse
    return output


def flash_dual_chunk(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    moved_key_cache: torch.Tensor,
    requests: Requests,
    parts: Sequence[Part],
    chunk: int,
    inv_freq: torch.Tensor,
    scale: float,
    varlen: Callable,
    merge: Callable,
    output: torch.Tensor,
) -> torch.Tensor:
    """DCA's attention (An et al. 2024, section 3; :class:`longreach.methods.dca.DualChunk`: its three ``parts``, its
    chunk ``c``) by three FlashAttention calls, written into ``output [T, Hq, D]``; the other arguments as
    :func:`flash_cells`'s, ``moved_key_cache`` the plane of keys at ``j mod c``. Each request's queries are cut at chunk
    edges into pieces (at most ``requests + T / c + 1``, known without a host sync); the piece of chunk ``m`` attends,
    each call with its query turned as its part says:

    * its own chunk, causally: block table from key ``m c``, ``m c .. i`` (``seqused_k`` = its last position + 1 -
      ``m c``, the causal mask aligned to the bottom right);
    * the previous chunk, whole: block table from ``(m - 1) c``, ``c`` keys, not causal;
    * every earlier chunk: the request's block table, ``(m - 1) c`` keys, not causal.
    """
    c, tokens, block_size, device = chunk, query.shape[0], key_cache.shape[1], query.device
    query_start, seq_lens, block_table = requests.query_start, requests.seq_lens, requests.block_table
    positions = token_positions(query_start, seq_lens, tokens)
    queries, view_of = moved_queries(query, lower(parts, None), positions, inv_freq)
    q_lens = query_start[1:] - query_start[:-1]
    first_chunk = torch.div(seq_lens - q_lens, c, rounding_mode="floor")
    pieces_per = torch.where(q_lens > 0, torch.div(seq_lens - 1, c, rounding_mode="floor") - first_chunk + 1, 0)
    ends = pieces_per.cumsum(0)
    piece = torch.arange(len(seq_lens) + tokens // c + 1, device=device)  # a bound on the pieces: no host sync
    request = torch.searchsorted(ends, piece, right=True).clamp(max=len(seq_lens) - 1)
    real = piece < ends[-1]
    m = first_chunk[request] + piece - (ends - pieces_per)[request]  # each piece's chunk
    begin = torch.maximum(seq_lens[request] - q_lens[request], m * c)
    end = torch.minimum(seq_lens[request], (m + 1) * c)
    counts = torch.where(real, end - begin, 0)
    cu_pieces = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(query_start.dtype)
    width = block_table.shape[1]
    columns = torch.arange(width, device=device)

    def table_from(first_key: torch.Tensor) -> torch.Tensor:  # each piece's block table from a chunk's first key
        start = torch.div(first_key.clamp(min=0), block_size, rounding_mode="floor")
        return block_table[request].gather(1, (start[:, None] + columns).clamp(max=width - 1))

    calls = [  # (block table, keys used, causal) per part: own chunk, previous chunk, earlier chunks
        (table_from(m * c), torch.where(real, end - m * c, 0), True),
        (table_from((m - 1) * c), torch.where(real & (m >= 1), c, 0), False),
        (block_table[request], torch.where(real & (m >= 2), (m - 1) * c, 0), False),
    ]
    results = [
        varlen(
            q=queries[view],
            k=moved_key_cache,
            v=value_cache,
            max_seqlen_q=min(requests.max_query_len, c),
            cu_seqlens_q=cu_pieces,
            max_seqlen_k=requests.max_seq_len,
            seqused_k=used.to(seq_lens.dtype),
            softmax_scale=scale,
            causal=causal,
            window_size=[-1, -1 if not causal else 0],
            block_table=table,
            return_softmax_lse=True,
        )
        for view, (table, used, causal) in zip(view_of, calls, strict=True)
    ]
    (own, own_lse), (previous, previous_lse), (earlier, earlier_lse) = results
    near, near_lse = torch.empty_like(own), torch.empty_like(own_lse)
    merge(near, own, own_lse, previous, previous_lse, output_lse=near_lse)
    merge(output, near, near_lse, earlier, earlier_lse)
    return output

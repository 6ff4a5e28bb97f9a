"""Whole attention rows, a tile of queries at a time: Drop Attention, and the probes that read probabilities.

Drop Attention (Dynamic Drop Attention paper, Eq. 1) drops a row's scores below the row's quantile,
so a row's scores over every key it may attend must exist before its softmax. They are computed
``DROP_TILE`` queries at a time, each pair scored in the part it belongs to, so memory is O(tile x n):

* **Widths of a few sizes.** Each tile's key window, and each part's keys inside it, are widened to
  multiples of ``kv_len / WIDTHS`` (the extra pairs are masked). Every per-tile tensor then has one of
  a few shapes: the allocator reuses their memory instead of leaving a hole of a new size behind each
  tile (with tiles as wide as their causal rows, CPU peak memory grew as n^2 through heap
  fragmentation: 3.4 GB at 32K in the review).
* **Recomputation in backward.** :class:`_DroppedRows` keeps the output, not the probabilities; its
  backward recomputes each tile's probabilities (FlashAttention's recomputation, Dao et al. 2022,
  section 3.1; the dropped set is a constant of the scores, as a ReLU's zero set) and applies
  ``dS = P * (dO V^T - rowsum(dO * O))`` (ibid., Algorithm 4) part by part.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch

from . import plan, shifts
from .cells import Cell, lower
from .heads import expand_heads, grouped_matmul, per_kv_head
from .parts import NEG_INF
from .rotary import compute_dtype

DROP_TILE = 32  # query rows per tile: O(32 * n) memory
WIDTHS = 8  # key windows are multiples of ceil(kv_len / WIDTHS): a tile's tensors take at most WIDTHS + 1 widths
WIDTH_ALIGNMENT = 64


class Tile(NamedTuple):
    """One tile of rows: the query ``rows`` (indices into the queries), the key window ``keys``, and per
    part the keys it scores (inside the window) with the pairs of the part among them (``allowed``)."""

    rows: slice
    keys: slice
    parts: list[tuple[int, slice, torch.Tensor]]


def attention_probabilities(
    query,
    key,
    parts,
    inv_freq,
    rows,
    scaling=None,
    key_padding=None,
    sliding_window=None,
    logit_scale=1.0,
    positions=None,
    drop=None,
) -> Iterator[tuple[torch.Tensor, slice]]:
    """Whole attention rows of the queries at absolute indices ``rows``: yields ``(probabilities [B, H, T, K],
    keys)``, each valid until the next is asked for.

    ``query [B, Hq, R, D]`` may be any subset of the positions (a dispersion probe samples some); the
    arguments mean what they mean in :func:`longreach.attention.kernel.attention`.
    """
    query, key, scaling, positions = shifts.prepare(query, key, inv_freq, scaling, logit_scale, positions)
    if shifts.pairs_split_groups(parts, key.shape[1], query.shape[1]):
        key = expand_heads(key, query.shape[1])
    cells = lower(parts, sliding_window)
    shifted = _shifted_cells(query, key, cells, inv_freq, rows, positions)
    for tile in _tiles(cells, rows, key.shape[2], key_padding, positions, sliding_window):
        yield _probabilities(tile, query, shifted, scaling, drop), tile.keys


def dropped_attention(
    query,
    key,
    value,
    parts,
    inv_freq,
    rows,
    drop,
    scaling=None,
    key_padding=None,
    sliding_window=None,
    logit_scale=1.0,
    positions=None,
) -> torch.Tensor:
    """Attention of the queries at absolute indices ``rows`` with Drop Attention's ``drop [B, R]`` rates:
    ``[B, Hq, R, D]`` in the accumulation dtype, differentiable with O(tile x n) memory."""
    query, key, scaling, positions = shifts.prepare(query, key, inv_freq, scaling, logit_scale, positions)
    if shifts.pairs_split_groups(parts, key.shape[1], query.shape[1]):
        key, value = expand_heads(key, query.shape[1]), expand_heads(value, query.shape[1])
    cells = lower(parts, sliding_window)
    shifted = _shifted_cells(query, key, cells, inv_freq, rows, positions)
    plan = (cells, rows, key.shape[2], key_padding, positions, sliding_window)
    return _DroppedRows.apply(plan, scaling, drop, query, value, *[t for pair in shifted for t in pair])


def _shifted_cells(
    query, key, cells: Sequence[Cell], inv_freq, rows, positions
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each cell's query and key, moved by its part's shifts."""
    return [
        (
            shifts.shifted(query, cell.query_shift, positions[:, rows], inv_freq, cell.part.pairs),
            shifts.shifted(key, cell.key_shift, positions, inv_freq, cell.part.pairs),
        )
        for cell in cells
    ]


def _tiles(
    cells: Sequence[Cell], rows: torch.Tensor, kv_len: int, key_padding, positions, sliding_window
) -> Iterator[Tile]:
    """The tiles of ``rows`` (absolute indices), each with its key window and its cells' keys, widened to
    multiples of the width quantum (see the module)."""
    per_width = -(-kv_len // WIDTHS)  # ceil(kv_len / WIDTHS)
    quantum = -(-per_width // WIDTH_ALIGNMENT) * WIDTH_ALIGNMENT

    def widen(start, stop):
        return slice(start // quantum * quantum, min(kv_len, -(-stop // quantum) * quantum))

    for start in range(0, rows.numel(), DROP_TILE):
        tile_rows = rows[start : start + DROP_TILE]
        first = 0 if sliding_window is None else max(0, int(tile_rows.min()) - sliding_window + 1)
        window = widen(first, int(tile_rows.max()) + 1)
        scored = []
        for index, cell in enumerate(cells):
            span = None if cell.part.key_span is None else (cell.part.key_span, positions)
            bounds = plan.region_bounds(tile_rows, cell.lo, cell.hi, kv_len, span, window.start)
            if bounds is None:
                continue
            keys = widen(*bounds[:2])
            scored.append((index, keys, plan.allowed_pairs(tile_rows, keys, cell.lo, cell.hi, key_padding, span)))
        yield Tile(slice(start, start + tile_rows.numel()), window, scored)


def _scores(tile: Tile, query, shifted, scaling: float, drop) -> torch.Tensor:
    """The tile's scores ``[B, Hq, T, K]`` over its key window in the accumulation dtype, -inf where no cell holds
    the pair, Drop Attention's rates applied."""
    compute = compute_dtype(query.dtype)
    scores = torch.full(
        (*query.shape[:2], tile.rows.stop - tile.rows.start, tile.keys.stop - tile.keys.start),
        NEG_INF,
        dtype=compute,
        device=query.device,
    )
    for index, keys, allowed in tile.parts:
        q, k = shifted[index]
        part = grouped_matmul(q[:, :, tile.rows].to(compute), k[:, :, keys].to(compute).transpose(-1, -2)) * scaling
        window = scores[..., keys.start - tile.keys.start : keys.stop - tile.keys.start]
        window.copy_(torch.where(allowed, part, window))
    return scores if drop is None else drop_below_quantile(scores, drop[:, tile.rows])


def _probabilities(tile: Tile, query, shifted, scaling: float, drop) -> torch.Tensor:
    return torch.softmax(_scores(tile, query, shifted, scaling, drop), dim=-1).nan_to_num(0.0)


def drop_below_quantile(scores: torch.Tensor, rates: torch.Tensor) -> torch.Tensor:
    """Drop Attention: per row, scores below the row's ``rate``-quantile of its attendable scores become -inf.

    ``scores [B, H, T, K]`` is -inf where a key may not be attended; ``rates [B, T]`` in [0, 1).
    With ``m`` attendable scores in ascending order ``s_0 <= ... <= s_{m-1}``, the threshold is the
    order statistic ``s_k``, ``k = ceil(rate * (m - 1))``: exactly the scores that ``torch.quantile``
    (linear interpolation) puts strictly below the quantile, decided on the scores themselves so
    that float32 and float64 agree. Scores equal to ``s_k`` are kept: the best key always survives.

    One ``kthvalue`` (selection, not a sort) serves the whole tile although rows differ in ``k``:
    unattendable scores go last (+inf) and row ``t`` gets ``k_max - k_t`` extra -inf entries in
    front, so its ``s_{k_t}`` is the ``k_max``-th order statistic of its padded row. The fillers'
    width is a multiple of ``WIDTH_ALIGNMENT``, so the padded rows, too, take a few widths only.
    """
    rank = threshold_rank(rates, torch.isfinite(scores[:, 0]).sum(-1))  # [B, T]: the same keys for every head
    top = int(rank.max())
    if top == 0:
        return scores
    fillers = top - rank  # [B, T]
    width = scores.shape[-1]
    padded = scores.new_empty(
        (*scores.shape[:-1], width + -(-(int(fillers.max()) + 1) // WIDTH_ALIGNMENT) * WIDTH_ALIGNMENT)
    )
    padded[..., :width] = scores
    padded[..., :width].masked_fill_(torch.isneginf(scores), float("inf"))
    filler = torch.arange(padded.shape[-1] - width, device=scores.device) < fillers[..., None]  # [B, T, P]
    padded[..., width:] = torch.where(filler, NEG_INF, float("inf"))[:, None]
    threshold = padded.kthvalue(top + 1, dim=-1).values  # [B, H, T]
    return scores.masked_fill(scores < threshold[..., None], NEG_INF)


def threshold_rank(rates: torch.Tensor, attendable: torch.Tensor) -> torch.Tensor:
    """``k = ceil(rate (m - 1))``, the order statistic below which a row of ``m`` attendable scores drops (0, the
    row's minimum, where nothing drops); ``rates`` and ``attendable`` broadcast together."""
    rank = torch.ceil(rates.double() * (attendable - 1).clamp(min=0) - 1e-9).long()
    return torch.where((rates > 0) & (attendable > 0), rank, 0)


class _DroppedRows(torch.autograd.Function):
    """Dropped rows with a backward that recomputes each tile's probabilities (see the module): memory
    O(tile x n) in training as in inference. Inputs after the value: each part's moved query and key."""

    @staticmethod
    def forward(ctx, plan, scaling, drop, query, value, *flat):
        shifted = list(zip(flat[0::2], flat[1::2], strict=True))
        out = torch.zeros((*query.shape[:3], value.shape[-1]), dtype=compute_dtype(query.dtype), device=query.device)
        for tile in _tiles(*plan):
            probabilities = _probabilities(tile, query, shifted, scaling, drop)
            out[:, :, tile.rows] = grouped_matmul(probabilities, value[:, :, tile.keys].to(out.dtype))
        ctx.save_for_backward(query, value, out, *flat)
        ctx.plan, ctx.scaling, ctx.drop = plan, scaling, drop
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, value, out, *flat = ctx.saved_tensors
        shifted = list(zip(flat[0::2], flat[1::2], strict=True))
        accumulate = out.dtype
        grad_value = torch.zeros(value.shape, dtype=accumulate, device=value.device)
        grads = [torch.zeros(t.shape, dtype=accumulate, device=t.device) for t in flat]
        grad_out = grad_out.to(accumulate)
        row_dots = (grad_out * out).sum(-1, keepdim=True)  # rowsum(dO * O)
        kv_heads = value.shape[1]
        for tile in _tiles(*ctx.plan):
            probabilities = _probabilities(tile, query, shifted, ctx.scaling, ctx.drop)
            d_out = grad_out[:, :, tile.rows]
            grad_value[:, :, tile.keys] += per_kv_head(probabilities.transpose(-1, -2) @ d_out, kv_heads)
            d_scores = probabilities * (
                grouped_matmul(d_out, value[:, :, tile.keys].to(accumulate).transpose(-1, -2))
                - row_dots[:, :, tile.rows]
            )
            for index, keys, allowed in tile.parts:
                q, k = shifted[index]
                part = d_scores[..., keys.start - tile.keys.start : keys.stop - tile.keys.start] * allowed * ctx.scaling
                grads[2 * index][:, :, tile.rows] += grouped_matmul(part, k[:, :, keys].to(accumulate))
                grads[2 * index + 1][:, :, keys] += per_kv_head(
                    part.transpose(-1, -2) @ q[:, :, tile.rows].to(accumulate), k.shape[1]
                )
        grads_in_dtypes = (g.to(t.dtype) for g, t in zip(grads, flat, strict=True))
        return (None, None, None, None, grad_value.to(value.dtype), *grads_in_dtypes)

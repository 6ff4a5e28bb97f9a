"""``cuda_flash``: each cell one FlashAttention call with a window, the official STRING code's algorithm, on CUDA.

A part's pairs ``lo <= i - j < hi`` are a causal band. FlashAttention-2 (Dao 2023) aligns its causal mask to
the bottom right when there are fewer queries than keys and takes a left window, so the rows ``i >= lo``
against the keys ``j < Lkv - lo`` with ``window_size_left = hi - lo - 1`` (-1: unbounded) are exactly the
part: row ``i`` meets ``i - hi < j <= i - lo``. STRING is then two calls -- the band ``d < S`` at the
original positions and the far triangle with the queries moved back by ``S - W`` -- and one log-sum-exp
merge, as in the official code (``string_flash_forward`` in HKUNLP/STRING's ``string_for_llama.py``: a
``flash_attn_func`` call with ``window_size=[S - 1, 0]`` and one on the shifted rows). PyTorch ships the
kernel as ``aten._flash_attention_forward`` (CUDA, float16/bfloat16); no flash-attn package is needed.

A decoding step (one query row, ``i = Lkv - 1``) needs neither the causal mask nor a window: its keys are sliced to
the band, ``Lkv - hi <= j < Lkv - lo``, and the call is unmasked (``window_size = [-1, -1]``). Only such a call
takes FlashAttention's grouped-query decoding path, which folds the query heads of a group into the rows
(``seqlenq_ngroups_swapped`` in PyTorch's ``flash_api.cpp``: one query row, not causal, both windows negative).

For parts given by distance alone, on unpadded batches (FlashAttention has no mask); anything else --
key padding, DCA's key spans, DPE's per-head pairs, gradients -- it hands to ``cuda_efficient``, the tiled kernel.
"""

from __future__ import annotations

import torch

from ..call import Call
from ..cells import Cell
from ..merge import merge
from ..parts import NEG_INF
from ..shifts import shifted, shifted_keys
from .base import Backend


def _flash_forward(*args, **kwargs):
    """PyTorch's FlashAttention-2 forward on ``[B, L, H, D]`` tensors: ``(out, lse [B, H, Lq], ...)``."""
    return torch.ops.aten._flash_attention_forward(*args, **kwargs)


def available(query: torch.Tensor) -> bool:
    """Whether PyTorch's FlashAttention kernel takes ``query``: CUDA, float16 or bfloat16, head dim <= 256."""
    return (
        query.device.type == "cuda"
        and query.dtype in (torch.float16, torch.bfloat16)
        and query.shape[-1] <= 256
        and hasattr(torch.ops.aten, "_flash_attention_forward")
    )


class CudaFlash(Backend):
    name = "cuda_flash"
    summary = "each cell one FlashAttention call with a window, as the official STRING code (CUDA, half precision)"
    model_devices = ("cuda",)
    fallback = "cuda_efficient"

    def unavailable(self, query) -> str | None:
        if available(query):
            return None
        return (
            f"backend='cuda_flash' needs PyTorch's FlashAttention: a CUDA device and float16 or bfloat16 inputs "
            f"(head dim <= 256); got {query.device.type} {str(query.dtype).removeprefix('torch.')}"
        )

    def prepare(self, cells: tuple[Cell, ...], call: Call) -> tuple[Cell, ...] | None:
        """The cells, where each is a band FlashAttention can take: no padding, key spans, per-head pairs or
        gradients."""
        if call.key_padding is not None or call.needs_grad:
            return None
        return cells if all(cell.by_distance_alone for cell in cells) else None

    def run(self, prepared: tuple[Cell, ...], cells: tuple[Cell, ...], call: Call) -> tuple[torch.Tensor, torch.Tensor]:
        """Each cell's band (of ``prepared``, the cells :meth:`prepare` took) on the query and keys its shifts move,
        merged by log-sum-exp."""
        (out, lse), *others = [
            _band(
                shifted(call.query, cell.query_shift, call.q_positions, call.inv_freq),
                shifted_keys(call.key, cell.key_shift, call.positions, call.inv_freq),
                call.value,
                cell.lo,
                cell.hi,
                call.scaling,
            )
            for cell in prepared
        ]
        for cell_out, cell_lse in others:
            out, lse = merge(out, lse, cell_out, cell_lse)
        return out, lse


def _band(q, k, value, lo: int, hi: int | None, scaling: float):
    """The pairs ``lo <= i - j < hi`` in one call. Prefill: rows ``i >= lo`` (the others are empty) against keys
    ``j < Lkv - lo``, causal (bottom right) with the left window ``hi - lo - 1``. A decoding step (its row
    ``i = Lkv - 1``): the keys ``max(0, Lkv - hi) <= j < Lkv - lo`` alone, unmasked -- FlashAttention's
    grouped-query decoding path."""
    batch, heads, q_len, _ = q.shape
    kv_len = k.shape[2]
    first = max(0, lo - (kv_len - q_len))  # the first row that reaches a key of the part
    if q_len == 1 and lo < kv_len:
        band = slice(0 if hi is None else max(0, kv_len - hi), kv_len - lo)
        return flash(q, k[:, :, band], value[:, :, band], scaling, causal_window=None)
    out = torch.zeros(batch, heads, q_len, value.shape[-1], dtype=torch.float32, device=q.device)
    lse = torch.full((batch, heads, q_len), NEG_INF, dtype=torch.float32, device=q.device)
    if first >= q_len or kv_len - lo <= 0:
        return out, lse
    window = -1 if hi is None else hi - lo - 1
    rows_out, rows_lse = flash(
        q[:, :, first:], k[:, :, : kv_len - lo], value[:, :, : kv_len - lo], scaling, causal_window=window
    )
    out[:, :, first:], lse[:, :, first:] = rows_out, rows_lse
    return out, lse


def flash(q, k, v, scaling: float, causal_window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``aten._flash_attention_forward`` on ``[B, H, L, D]`` tensors: causal (aligned to the bottom right) with the
    left window ``causal_window`` (-1: unbounded), or unmasked (``None``: not causal, both windows -1);
    ``(out [B, Hq, Lq, D], lse [B, Hq, Lq])`` in float32. FlashAttention reports a row with no key as
    ``lse = +inf``; here it is ``-inf`` (and 0), what :func:`.merge.merge` reads as empty."""
    out, lse, *_ = _flash_forward(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        None,
        None,
        q.shape[2],
        k.shape[2],
        0.0,
        causal_window is not None,
        False,
        scale=scaling,
        window_size_left=-1 if causal_window is None else causal_window,
        window_size_right=-1 if causal_window is None else 0,
    )
    empty = ~torch.isfinite(lse)
    return out.transpose(1, 2).float().masked_fill(empty[..., None], 0.0), lse.float().masked_fill(empty, NEG_INF)


BACKEND = CudaFlash()

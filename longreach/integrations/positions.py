"""What the attention function learns from transformers' mask: the keys' absolute positions.

Registered with ``AttentionMaskInterface`` (see :mod:`.transformers`), :func:`key_positions_mask` hands every
layer the keys' positions ``[B, 1, 1, Lkv]`` -- counting real tokens, as ``generate`` does -- with -1 at padding
and -2 at a static cache's empty slots, instead of a dense causal mask; :func:`keys_of` reads them back in the
attention function.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers.masking_utils import causal_mask_function

from ..attention.compiled_step import EMPTY

PADDING = -1  # the mask's mark of a padding key (attended by no query); EMPTY: a static cache's empty slot (no key)


def _plain_causal(mask_function: Callable | None) -> bool:
    """Whether transformers asked for a causal (or causal sliding-window) mask, the only kinds the kernel builds."""
    if mask_function is None or mask_function is causal_mask_function:
        return True
    if getattr(mask_function, "__name__", "") != "and_mask" or not mask_function.__closure__:
        return False
    parts = [
        f
        for cell in mask_function.__closure__
        for f in (cell.cell_contents if isinstance(cell.cell_contents, tuple) else ())
    ]
    return bool(parts) and all(
        f is causal_mask_function or getattr(f, "__qualname__", "").startswith("sliding_window_overlay") for f in parts
    )


def key_positions_mask(
    batch_size,
    q_length,
    kv_length,
    q_offset=0,
    kv_offset=0,
    attention_mask=None,
    mask_function=None,
    allow_is_causal_skip=True,
    **_,
) -> torch.Tensor | None:
    """``AttentionMaskInterface`` function: the keys' absolute positions ``[B, 1, 1, Lkv]``, -1 at padding.

    Keys at or beyond ``q_offset + q_length`` are empty slots of a static cache: -2. With padding the
    positions count real tokens (``cumsum(mask) - 1``, as ``generate`` does), also when the caller gave
    no ``position_ids``. ``None`` when every key is real and unpadded, unless transformers allows no skip (a
    decoding step with a compileable cache: a full static cache keeps getting positions, so that the compiled
    step sees the same arguments at every step and compiles once).
    """
    # transformers adds a packed-sequence mask only to calls without a cache (q_length == kv_length); a compiled graph
    # cannot read a mask function's closures, so a compiled call with a cache (a decoding step) trusts it is causal
    if (q_length == kv_length or not torch.compiler.is_compiling()) and not _plain_causal(mask_function):
        raise ValueError(
            "longreach attention supports causal attention with a 2D padding mask only; this call asked for another "
            "mask (packed sequences in one row, or a model-specific mask): unpack the sequences or pass an "
            "attention_mask"
        )
    device = attention_mask.device if attention_mask is not None else None
    if torch.compiler.is_compiling():  # no host sync: the marks always, decided on the device
        return _marks(batch_size, q_length, kv_length, q_offset, kv_offset, attention_mask, device)
    end = q_offset + q_length  # the keys that exist: every cached token and the queries
    index = torch.arange(kv_offset, kv_offset + kv_length, device=device)
    empty = index >= end
    if attention_mask is None:
        if not bool(empty.any()) and allow_is_causal_skip:
            return None
        return index.masked_fill(empty, EMPTY).expand(batch_size, -1)[:, None, None, :]
    full = attention_mask.bool()
    if (missing := kv_offset + kv_length - full.shape[-1]) > 0:  # as transformers pads it: the new tokens are real
        full = torch.nn.functional.pad(full, (0, missing), value=True)
    real = full[:, kv_offset : kv_offset + kv_length] & ~empty
    padded = not bool(full[:, : int(end)].all())
    if not padded:
        if bool(real.all()) and allow_is_causal_skip:
            return None
        return index.masked_fill(empty, EMPTY).expand(batch_size, -1)[:, None, None, :]
    positions = full.long().cumsum(-1)[:, kv_offset : kv_offset + kv_length] - 1
    return positions.masked_fill(~real, PADDING).masked_fill(empty, EMPTY)[:, None, None, :]


def _marks(batch_size, q_length, kv_length, q_offset, kv_offset, attention_mask, device) -> torch.Tensor:
    """:func:`key_positions_mask`'s marks as one expression of tensors, never ``None`` (for a compiled step)."""
    index = torch.arange(kv_offset, kv_offset + kv_length, device=device)
    empty = index >= q_offset + q_length
    if attention_mask is None:
        return index.masked_fill(empty, EMPTY).expand(batch_size, -1)[:, None, None, :]
    full = attention_mask.bool()
    if (missing := kv_offset + kv_length - full.shape[-1]) > 0:
        full = torch.nn.functional.pad(full, (0, missing), value=True)
    real = full[:, kv_offset : kv_offset + kv_length] & ~empty
    positions = full.long().cumsum(-1)[:, kv_offset : kv_offset + kv_length] - 1
    return positions.masked_fill(~real, PADDING).masked_fill(empty, EMPTY)[:, None, None, :]


@dataclass
class Keys:
    """The keys of one attention call: how many (a static cache's empty slots dropped), which are padding,
    their absolute positions for the method, and the positions RoPE rotated them at."""

    count: int
    padding: torch.Tensor | None  # [B, count] bool, False at padding; None: no padding
    positions: torch.Tensor  # [B, count]
    rotated_at: torch.Tensor  # [B, count]


def keys_of(mask: torch.Tensor | None, kv_len: int, position_ids: torch.Tensor | None, batch: int, device) -> Keys:
    if mask is None:
        count, padding, marks = kv_len, None, None
    else:
        if mask.dim() != 4 or mask.shape[-2] != 1 or mask.shape[-1] != kv_len or mask.dtype != torch.int64:
            raise ValueError(
                f"longreach attention got a custom attention mask of shape {tuple(mask.shape)} ({mask.dtype}); "
                "it supports causal attention with a 2D padding mask [batch, keys] only"
            )
        marks = mask[:, 0, 0, :].to(device)
        present = (marks != EMPTY).any(0).nonzero()  # right padding is kept: the queries there are its last tokens
        count = int(present[-1]) + 1 if present.numel() else kv_len
        marks = marks[:, :count]
        real = marks >= 0
        padding = None if bool(real.all()) else real
    back = torch.arange(count - 1, -1, -1, device=device)
    last = torch.full((1, 1), count - 1, device=device) if position_ids is None else position_ids.to(device)[:, -1:]
    rotated_at = (last - back).expand(batch, -1)
    # the mask's positions count real tokens also where the keys at hand hold no padding (a sliding
    # cache past the left padding): position_ids, when the caller gave none, do not
    positions = marks if marks is not None else rotated_at
    return Keys(count, padding, positions, rotated_at)

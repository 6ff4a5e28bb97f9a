"""``cuda_flash``: each cell one FlashAttention call. This machine has no GPU: a float32 masked softmax with
FlashAttention-2's masks (Dao 2023: the causal mask aligned to the bottom right, left and right windows) stands in for
``aten._flash_attention_forward``, and the calls -- the same on any device -- are checked against the float64
reference; tests/test_cuda.py runs the real kernel."""

import pytest
import torch
from helpers.cases import DISTANCE_METHODS, attend, case, expected

from longreach.attention import backends, block_math
from longreach.attention.backends import cuda_flash
from longreach.attention.cells import lower
from longreach.methods import create


def flash_stand_in(
    q, k, v, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *, scale, **windows
):
    """``aten._flash_attention_forward`` on the CPU in float32: ``[B, L, H, D]`` tensors, grouped-query heads, row
    ``i`` (key index ``i + Lk - Lq``, the bottom-right alignment) meets keys ``i + Lk - Lq - left <= j <=
    i + Lk - Lq + right`` (a window of -1 is unbounded; causal makes ``right = 0``). ``(out [B, Lq, H, D],
    lse [B, H, Lq])``, a row with no key reported as ``lse = +inf`` and output 0, as FlashAttention does."""
    assert dropout_p == 0.0 and cum_seq_q is None and cum_seq_k is None
    left, right = windows["window_size_left"], 0 if is_causal else windows["window_size_right"]
    q, k, v = (x.transpose(1, 2).float() for x in (q, k, v))
    k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    i = torch.arange(q.shape[2])[:, None] + k.shape[2] - q.shape[2]
    j = torch.arange(k.shape[2])[None]
    allowed = ((right < 0) | (j <= i + right)) & ((left < 0) | (j >= i - left))
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    out = torch.nan_to_num(torch.softmax(scores, -1)) @ v
    return out.transpose(1, 2), torch.where(torch.isneginf(lse), float("inf"), lse), None, None, None


@pytest.fixture
def calls(monkeypatch):
    """FlashAttention's calls, made by the stand-in: ``(rows, keys, query heads, key heads, causal, left window,
    right window)`` each."""
    made = []

    def recorded(q, k, *args, **kwargs):
        window = kwargs["window_size_left"], kwargs["window_size_right"]
        made.append((q.shape[1], k.shape[1], q.shape[2], k.shape[2], args[6], *window))
        return flash_stand_in(q, k, *args, **kwargs)

    monkeypatch.setattr(cuda_flash, "_flash_forward", recorded)
    monkeypatch.setattr(cuda_flash, "available", lambda query: True)
    return made


def flash_attention(method, example, q_len, sliding_window=None):
    """``backend="cuda_flash"`` on the last ``q_len`` queries of ``example`` (a :func:`case`), at its positions."""
    positions = example[5]
    return attend(
        method, example, q_len, scaling=0.3, positions=positions, sliding_window=sliding_window, backend="cuda_flash"
    )


@pytest.mark.slow
@pytest.mark.parametrize("name, params", DISTANCE_METHODS)
@pytest.mark.parametrize("n", [20, 120, 131])
def test_every_distance_method_in_prefill_and_decoding_equals_the_reference(calls, name, params, n):
    """GQA 4:2; at n = 20 the far parts hold no pair."""
    method = create(name, training_window=120, **params)
    example = case(n)
    q, k, v, q_rot, k_rot, positions, padding, inv_freq = example
    for q_len in (n, 1):
        want, rows = expected(method, q, k, v, positions, padding, inv_freq, q_len, scaling=0.3)
        calls.clear()
        got = flash_attention(method, example, q_len)
        assert calls and (got - want)[rows].abs().max() <= 1e-5, q_len


@pytest.mark.parametrize("name, params", DISTANCE_METHODS)
@pytest.mark.parametrize("sliding_window", [None, 50])
def test_a_decoding_step_is_unmasked_calls_on_the_keys_of_each_band(calls, name, params, sliding_window):
    """The decoding row ``i = n - 1`` meets the keys ``max(0, n - hi) <= j < n - lo`` of each cell, and only those,
    in a call that is not causal and has no window -- PyTorch's FlashAttention takes its grouped-query decoding
    path on such a call alone; the key heads reach it unrepeated. Prefill stays causal with a left window."""
    n = 131
    method = create(name, training_window=120, **params)
    example = case(n)
    cells = lower(method.parts(), sliding_window)
    flash_attention(method, example, 1, sliding_window)
    band_keys = [min(n, n if cell.hi is None else cell.hi) - cell.lo for cell in cells]
    assert calls == [(1, keys, 4, 2, False, -1, -1) for keys in band_keys]
    calls.clear()
    flash_attention(method, example, n, sliding_window)
    windows = [-1 if cell.hi is None else cell.hi - cell.lo - 1 for cell in cells]
    assert calls == [
        (n - cell.lo, n - cell.lo, 4, 2, True, window, 0) for cell, window in zip(cells, windows, strict=True)
    ]


@pytest.mark.parametrize("name, params", DISTANCE_METHODS)
def test_a_chunk_and_the_models_window_are_one_call_per_cell_and_a_padded_batch_goes_to_the_tiled_kernel(
    calls, monkeypatch, name, params
):
    """Five queries against the cache, and the model's sliding window in prefill: one call per cell, no tiles, equal to
    the reference. FlashAttention takes no mask: a padded batch is the tiled kernel's (``cuda_efficient``, its blocks
    computed by the math backend on this CPU), with no FlashAttention call."""
    method = create(name, training_window=120, **params)
    example = case(70)
    q, k, v, q_rot, k_rot, positions, padding, inv_freq = example
    for q_len, window in ((5, None), (70, 33)):
        want, rows = expected(method, q, k, v, positions, padding, inv_freq, q_len, scaling=0.3, window=window)
        calls.clear()
        got = flash_attention(method, example, q_len, window)
        assert (got - want)[rows].abs().max() <= 1e-5 and len(calls) == len(lower(method.parts(), window))
    example = case(70, pads=(0, 9))
    q, k, v, q_rot, k_rot, positions, padding, inv_freq = example
    want, rows = expected(method, q, k, v, positions, padding, inv_freq, 70, scaling=0.3)
    monkeypatch.setattr(backends.REGISTRY["cuda_efficient"], "block", block_math.block)
    calls.clear()
    got = attend(method, example, scaling=0.3, key_padding=padding, positions=positions, backend="cuda_flash")
    assert (got - want)[rows].abs().max() <= 1e-5 and not calls

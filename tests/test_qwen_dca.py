"""Qwen2.5-1M's Dual Chunk Attention: longreach's DCA with ``mscale="qwen"`` against Qwen's own definition.

The reference is written from Qwen's vLLM code (vLLM 0.10, ``dual_chunk_rope.py`` and ``dual_chunk_flash_attn.py``),
not from longreach's parts: three rotations of each query (at ``i mod c``, ``min(i mod c + c, s)`` and
``min(2c - 1, s)``), keys at ``j mod c``, one softmax per chunk relation merged by their log-sum-exps, and the
temperature ``f = max(1, 0.1 ln(n / L) + 1)`` on the keys and on the softmax scale. In float64, dense, per query.
"""

import math

import pytest
import torch

import longreach
from longreach.attention.kernel import attention
from longreach.attention.rotary import rotate

CHUNK_SIZE, LOCAL, ORIGINAL = 48, 8, 64  # s, l and L; c = s - l = 40


def qwen_dual_chunk(query, key, value, inv_freq, scale):
    """Qwen's DCA for one prompt read in one pass (queries and keys unrotated ``[H, n, D]``, float64)."""
    n, c, s = query.shape[1], CHUNK_SIZE - LOCAL, CHUNK_SIZE
    factor = max(1.0, 0.1 * math.log(n / ORIGINAL) + 1)
    positions = torch.arange(n)
    keys = rotate(key, (positions % c).double(), inv_freq) * factor
    intra = rotate(query, (positions % c).double(), inv_freq)
    succ = rotate(query, (positions % c + c).clamp(max=s).double(), inv_freq)
    inter = rotate(query, float(min(2 * c - 1, s)), inv_freq)
    out = torch.empty_like(query)
    for i in range(n):
        start = i // c * c
        pieces = [(intra[:, i], slice(start, i + 1))]
        if start >= c:
            pieces.append((succ[:, i], slice(start - c, start)))
        if start >= 2 * c:
            pieces.append((inter[:, i], slice(0, start - c)))
        logits = [torch.einsum("hd,hkd->hk", q, keys[:, span]) * scale * factor for q, span in pieces]
        lse = torch.stack([torch.logsumexp(x, -1) for x in logits])  # merged as vLLM's _merge_attn_outputs
        weights = torch.softmax(lse, 0)
        outputs = [
            torch.einsum("hk,hkd->hd", x.softmax(-1), value[:, span])
            for x, (_, span) in zip(logits, pieces, strict=True)
        ]
        out[:, i] = sum(w[:, None] * o for w, o in zip(weights, outputs, strict=True))
    return out


@pytest.mark.parametrize("n", [60, 130, 200])  # inside L, past one chunk, past three
def test_dca_with_qwens_temperature_is_qwens_own_definition(n):
    torch.manual_seed(n)
    heads, dim = 2, 16
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    query, key, value = (torch.randn(heads, n, dim, dtype=torch.float64) for _ in range(3))
    scale = dim**-0.5
    want = qwen_dual_chunk(query, key, value, inv_freq, scale)
    method = longreach.methods.create(
        "dca", training_window=ORIGINAL, chunk_size=CHUNK_SIZE, local_window=LOCAL, mscale="qwen"
    )
    positions = torch.arange(n).double()
    rotated = [rotate(x, positions, inv_freq)[None] for x in (query, key)]  # RoPE at i, as a model hands them
    for backend, tolerance in (("cpu_flash", 1e-6), ("math", 1e-12)):  # the kernel accumulates in float32
        got = attention(
            *rotated,
            value[None],
            method.parts(),
            inv_freq,
            scaling=scale,
            logit_scale=method.logit_scale_at(torch.tensor([n])),
            backend=backend,
        )
        assert (got[0].transpose(0, 1) - want).abs().max() <= tolerance
    if n > ORIGINAL:  # the temperature is there: without it, the scores differ
        plain = longreach.methods.create("dca", training_window=ORIGINAL, chunk_size=CHUNK_SIZE, local_window=LOCAL)
        got = attention(*rotated, value[None], plain.parts(), inv_freq, scaling=scale, backend="cpu_flash")
        assert (got[0].transpose(0, 1) - want).abs().max() > 1e-3


def test_qwens_temperature_is_a_tenth_where_chunkllamas_is_a_twentieth():
    create = longreach.methods.create
    lengths = torch.tensor([50, 64, 256])
    qwen = create("dca", training_window=64, mscale="qwen").logit_scale_at(lengths)
    chunkllama = create("dca", training_window=64, mscale=True).logit_scale_at(lengths)
    assert qwen.tolist()[:2] == [1.0, 1.0] and qwen[2].item() == pytest.approx((0.1 * math.log(4) + 1) ** 2)
    assert chunkllama[2].item() == pytest.approx((0.05 * math.log(4) + 1) ** 2)
    with pytest.raises(ValueError, match=r"^mscale must be True, False or 'qwen', got 'yes'$"):
        create("dca", training_window=64, mscale="yes")


def test_apply_reads_a_qwen25_1m_config_and_explicit_parameters_win():
    from helpers.tiny_models import tiny_model

    own = {"chunk_size": 48, "local_size": 8, "original_max_position_embeddings": 64}
    model = tiny_model("qwen2", dual_chunk_attention_config=own, max_position_embeddings=1000)
    longreach.apply(model, "dca")
    assert longreach.describe(model) == "dca(chunk_size=48, local_window=8, mscale=qwen) [L=64]"
    longreach.apply(model, "dca", local_window=4, mscale=False)
    assert longreach.describe(model) == "dca(chunk_size=48, local_window=4, mscale=False) [L=64]"
    longreach.apply(model, "string")  # L is the length it was trained to for every method
    assert longreach.describe(model).endswith("[L=64]")
    assert longreach.training_window(tiny_model("qwen2", max_position_embeddings=1000).config) == 1000

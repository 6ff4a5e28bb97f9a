"""Each branch of :mod:`longreach.compat`, whichever release is installed (``make test-compat`` runs this file
on the oldest and the newest supported torch and transformers).

A branch the installed release does not take by itself is forced: the release-independent one (keys and
values repeated per head, ``return_lse``) is right on every release, so forcing it
checks that it computes the same as the native one.
"""

import types
import warnings

import pytest
import torch

from longreach import compat
from longreach.attention.backends import cpu_flash, flex
from longreach.attention.backends.flex import masks


def grouped_inputs(seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, 6, 8, generator=generator, requires_grad=True)
    k, v = (torch.randn(2, 2, 9, 8, generator=generator, requires_grad=True) for _ in range(2))
    return q, k, v


def repeated_attention(q, k, v, causal):
    """The same attention with keys and values repeated per query head, by plain autograd (the oracle)."""
    k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    scores = (q @ k.transpose(-1, -2)) * 0.3
    if causal:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(scores, -1) @ v


@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("causal", [True, False])
def test_cpu_flash_forward_and_backward_with_grouped_heads_on_either_branch(grouped, causal, monkeypatch):
    """Native grouped-query attention where the release computes it right; keys and values repeated per head
    (and their gradients summed back) where it does not. Both must equal the repeated-heads oracle."""
    if grouped and not compat.cpu_flash_takes_grouped_heads():
        pytest.skip(
            "this PyTorch release computes grouped heads wrongly in its CPU flash op: the other branch serves it"
        )
    monkeypatch.setattr(compat, "cpu_flash_takes_grouped_heads", lambda: grouped)
    q, k, v = grouped_inputs()
    out, lse = cpu_flash.block(q, k, v, None, causal, 0.3)
    want = repeated_attention(q, k, v, causal)
    assert torch.allclose(out, want, atol=1e-5)
    grad_out = torch.randn_like(want)
    expected = torch.autograd.grad(want, (q, k, v), grad_out)
    with torch.no_grad():
        got = cpu_flash.backward(grad_out, q, k, v, out, lse, None, causal, 0.3)
    for mine, theirs in zip(got, expected, strict=True):
        assert mine.shape == theirs.shape and torch.allclose(mine, theirs, atol=1e-5)


def test_the_grouped_heads_probe_answers_for_this_release():
    """The probe is a bool and the op with repeated heads is right: what the fallback branch relies on."""
    assert isinstance(compat.cpu_flash_takes_grouped_heads(), bool)
    q, k, v = grouped_inputs(1)
    k, v = (x.repeat_interleave(2, dim=1) for x in (k, v))
    out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=True, scale=0.3)[0]
    assert torch.allclose(out, repeated_attention(q, k, v, True), atol=1e-5)


@pytest.mark.skipif(not flex.available(torch.device("cpu")), reason="no FlexAttention in this PyTorch")
def test_flex_attention_returns_the_same_lse_through_either_interface():
    """``AuxRequest`` (PyTorch >= 2.9) and ``return_lse`` (before) give the same output and log-sum-exp."""
    module = masks._flex_module
    q, k, v = (x.detach() for x in grouped_inputs(2))
    k, v = (x.repeat_interleave(2, dim=1) for x in (k, v))

    def eager(*args, **kwargs):
        with warnings.catch_warnings():  # eager FlexAttention, and return_lse's deprecation from PyTorch 2.9 on
            warnings.simplefilter("ignore")
            return module.flex_attention(*args, **kwargs)

    old_interface = types.SimpleNamespace()  # no AuxRequest: the return_lse branch
    out_old, lse_old = compat.flex_attention_with_lse(eager, old_interface, q, k, v, scale=0.3)
    reference = torch.softmax((q @ k.transpose(-1, -2)) * 0.3, -1) @ v
    assert torch.allclose(out_old, reference, atol=1e-5)
    if hasattr(module, "AuxRequest"):
        out_new, lse_new = compat.flex_attention_with_lse(eager, module, q, k, v, scale=0.3)
        assert torch.allclose(out_new, out_old) and torch.allclose(lse_new, lse_old)

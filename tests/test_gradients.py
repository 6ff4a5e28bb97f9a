"""Backward through every method and backend: equal to autograd through the float64 dense reference.

The kernel merges parts by their log-sum-exp; the backends' own log-sum-exp carries no gradient,
so the kernel has a backward of its own (see ``longreach.attention.autograd.PartsAttention``). These tests fail if a
part's share of the gradient, the GQA sum over query heads, padding or decoding were wrong.
"""

import pytest
import torch
from helpers.cases import case
from helpers.gradients import METHODS, gradients
from helpers.tiny_models import tiny_model

import longreach
from longreach.attention import kernel, reference
from longreach.attention.rotary import rotate
from longreach.methods import create


@pytest.mark.parametrize("name, params", METHODS)
@pytest.mark.parametrize("backend", [pytest.param("cpu_flash", marks=pytest.mark.slow), "math"])
@pytest.mark.parametrize("pads", [(0, 0), (0, 6)])
def test_gradients_equal_the_reference_in_float64(name, params, backend, pads):
    method = create(name, training_window=40, **params)
    for n, q_len, tile in (
        (45, 45, 16),
        (45, 1, 16),
        (45, 13, 8),
        (90, 90, 32),
    ):  # prefill, decode, a chunk; whole blocks
        got, want = gradients(method, backend, n, q_len, pads, torch.float64, tile)
        for g, w, what in zip(got, want, "qkv", strict=True):  # the CPU flash op is ~5e-8 accurate even in float64
            assert (g - w).abs().max() <= {"math": 1e-12, "cpu_flash": 1e-6}[backend] * max(1.0, w.abs().max()), (
                what,
                n,
                q_len,
            )


@pytest.mark.parametrize("name, params", METHODS[1:2] + METHODS[-1:])
def test_gradients_in_float32_and_bfloat16(name, params):
    method = create(name, training_window=40, **params)
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 5e-2)):
        got, want = gradients(method, "auto", 90, 90, (0, 6), dtype, 32)
        for g, w in zip(got, want, strict=True):
            assert (g - w).abs().max() <= tolerance * max(1.0, w.abs().max())


@pytest.mark.slow
def test_gradcheck_against_finite_differences():
    """The classic check, independent of the reference: STRING with both parts, GQA, padding."""
    method = create("string", training_window=20, shift=5, local_window=2)
    q, k, v, q_rot, k_rot, positions, padding, inv_freq = case(
        12, batch=2, q_heads=2, kv_heads=1, dim=4, rotary_dims=4, pads=(0, 3)
    )

    def run(q, k, v):
        out = kernel.attention(
            q, k, v, method.parts(), inv_freq, scaling=0.5, key_padding=padding, positions=positions, tile=4
        )
        return out * padding[:, :, None, None]

    for backend_inputs in ((q_rot, k_rot, v),):
        inputs = [t.clone().requires_grad_(True) for t in backend_inputs]
        assert torch.autograd.gradcheck(run, inputs, eps=1e-6, atol=1e-7)


def test_drop_attention_gradients_equal_the_reference():
    q, k, v, q_rot, k_rot, positions, padding, inv_freq = case(40, pads=(0, 5))
    method = create("string", training_window=40, shift=9, local_window=2)
    rates = torch.full((2, 40), 0.3, dtype=torch.float64)
    rates[:, :10] = 0  # rows before the first dropping one take the fast path
    results = []
    for use_kernel in (True, False):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        if use_kernel:

            def rotated(x):
                return rotate(x, positions[:, None, :].double(), inv_freq)

            out = kernel.attention(
                rotated(leaves[0]),
                rotated(leaves[1]),
                leaves[2],
                method.parts(),
                inv_freq,
                scaling=0.3,
                key_padding=padding,
                positions=positions,
                drop=rates,
            )
        else:
            P = method.relative_positions(positions[:, :, None], positions[:, None, :])
            out = reference.dense_attention(*leaves, P, inv_freq, 0.3, key_padding=padding, drop_rates=rates)
        (out * padding[:, :, None, None]).square().sum().backward()
        results.append([leaf.grad for leaf in leaves])
    for g, w in zip(*results, strict=True):
        assert (g - w).abs().max() <= 1e-9 * max(1.0, w.abs().max())


@pytest.mark.parametrize("family", ["llama", "gemma3", "phi3"])
def test_fine_tuning_a_model_with_string_or_dca_gets_the_reference_gradients(family):
    """model.train() with dropout 0: parameter gradients through longreach equal the dense reference's."""
    x = torch.randint(3, 97, (2, 60), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(x)
    mask[1, :9] = 0
    for name, params in (("string", {"shift": 20, "local_window": 4}), ("dca", {"chunk_size": 30, "local_window": 6})):
        grads = []
        for backend in ("auto", "reference"):
            model = tiny_model(family, dtype=torch.float64).train()
            longreach.apply(model, name, backend=backend, **params)
            model(x, attention_mask=mask, labels=x).loss.backward()
            grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
        assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 10
        worst = max(
            ((grads[0][n] - grads[1][n]).abs().max() / (grads[1][n].abs().max() + 1e-12)).item() for n in grads[0]
        )
        assert worst <= 1e-8


@pytest.mark.parametrize(
    "name, params",
    [
        ("rope", {}),
        ("string", {"shift": 20, "local_window": 4}),
        ("self_extend", {"group_size": 3, "neighbor_window": 16}),
    ],
)
def test_right_padded_training_batches_give_each_rows_own_loss(name, params):
    """A collator with pad_to_multiple_of: rows of 37 and 45 tokens padded on the right to 48, every row ending in
    padding (the review: 'query length 48 exceeds key length 45'). The real tokens' logits are each row's own,
    the loss is stock's for rope, and every gradient is finite."""
    rows = [torch.randint(3, 97, (1, n), generator=torch.Generator().manual_seed(n)) for n in (37, 45)]
    x = torch.zeros(2, 48, dtype=torch.long)
    mask = torch.zeros_like(x)
    for i, row in enumerate(rows):
        x[i, : row.shape[1]], mask[i, : row.shape[1]] = row, 1
    labels = x.masked_fill(mask == 0, -100)
    model = tiny_model("llama", dtype=torch.float64).train()
    stock = model(x, attention_mask=mask, labels=labels).loss
    longreach.apply(model, name, **params)
    out = model(x, attention_mask=mask, labels=labels)
    for i, row in enumerate(rows):
        assert (out.logits[i, : row.shape[1]] - model(row).logits[0]).abs().max() <= 1e-10
    if name == "rope":
        assert out.loss.item() == pytest.approx(stock.item(), abs=1e-10)
    out.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)

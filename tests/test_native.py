"""The CPU kernel (longreach.attention.native, built from csrc/parts.cpp) against the float64 dense reference."""

import warnings

import pytest
import torch
from conftest import native_builds, tiny_model
from test_kernel import BASELINES, case, expected

import longreach
from longreach.attention import backends, kernel, native
from longreach.methods import create

pytestmark = pytest.mark.skipif(not native.available("cpu"), reason="needs a C++ compiler")


def test_the_kernel_builds_where_a_compiler_is():
    """CI has a compiler: a kernel that fails to build there is a failure, not a skip (auto would fall back silently)."""
    assert native_builds()

METHODS = [("rope", {}), ("string", {"shift": 40, "local_window": 5}), ("string", {"shift": 300, "local_window": 30, "mscale": True}),
           ("dca", {"chunk_size": 200, "local_window": 20}),  # few chunks: a decoding step turns one query per chunk
           *[(name, params) for name, params in BASELINES if name in ("rerope", "self_extend", "dca")]]


@pytest.fixture
def calls(monkeypatch):
    """How many times the C++ kernel ran."""
    counted = []
    real = native.parts_attention
    monkeypatch.setattr(native, "parts_attention", lambda *args, **kwargs: counted.append(1) or real(*args, **kwargs))
    monkeypatch.setitem(backends.BACKENDS, "cpu_fused", native.parts_attention)
    return counted


@pytest.mark.parametrize("name, params", METHODS)
@pytest.mark.parametrize("pads", [(0, 0), (3, 29)])
def test_every_method_matches_the_reference_in_prefill_chunks_and_decoding(name, params, pads, calls):
    """700 keys: three query tiles of 256, key tiles of 512 and cut edges; GQA 4:2; left padding; prefill, a chunk
    of 40 queries, and decoding (one and five queries: query heads packed per key/value head)."""
    method = create(name, training_window=600, **params)
    n = 700
    q, k, v, q_rot, k_rot, positions, padding, inv_freq = case(n, pads=pads)
    for q_len in (n, 40, 5, 1):
        want, rows = expected(method, q, k, v, positions, padding, inv_freq, q_len, scaling=0.3)
        got = kernel.attention(q_rot[:, :, -q_len:].float(), k_rot.float(), v.float(), method.parts(), inv_freq.float(), scaling=0.3,
                               key_padding=padding if pads[1] else None, positions=positions, backend="auto", logit_scale=method.logit_scale)
        assert got.dtype == torch.float32 and not got.isnan().any()
        assert (got - want)[rows].abs().max() <= 2e-5, q_len
    assert len(calls) == 4


@pytest.mark.parametrize("pad", [0, 1500])
def test_decoding_splits_the_keys_and_combines_them_exactly(pad, calls):
    """2,600 keys, one key/value head: the keys are split between tasks; with 1,500 padded keys the first split holds
    no key of the padded sequence."""
    method = create("string", training_window=2000, shift=700, local_window=50)
    q, k, v, q_rot, k_rot, positions, padding, inv_freq = case(2600, batch=2, q_heads=3, kv_heads=1, pads=(0, pad))
    for q_len in (1, 3):
        want, rows = expected(method, q, k, v, positions, padding, inv_freq, q_len, scaling=0.3)
        got = kernel.attention(q_rot[:, :, -q_len:].float(), k_rot.float(), v.float(), method.parts(), inv_freq.float(), scaling=0.3,
                               key_padding=padding if pad else None, positions=positions)
        assert (got - want)[rows].abs().max() <= 2e-5
    assert len(calls) == 2


def test_a_sliding_window_partial_rotary_one_key_head_and_padding_not_on_the_left(calls):
    """The model's window cuts every part; dimensions past the rotary pairs keep their values; GQA 4:1. Padding
    with a hole is the tiled kernel's (the C++ kernel takes a first real key per sequence only)."""
    method = create("rerope", training_window=60, window=12)
    n, window = 300, 70
    q, k, v, q_rot, k_rot, positions, padding, inv_freq = case(n, pads=(0, 11), rotary_dims=10, kv_heads=1)
    for q_len in (n, 2):
        want, rows = expected(method, q, k, v, positions, padding, inv_freq, q_len, scaling=0.3, window=window)
        got = kernel.attention(q_rot[:, :, -q_len:].float(), k_rot.float(), v.float(), method.parts(), inv_freq.float(), scaling=0.3,
                               key_padding=padding, positions=positions, sliding_window=window)
        assert (got - want)[rows].abs().max() <= 2e-5
    assert len(calls) == 2
    holed = padding.clone()
    holed[0, 50] = False
    kernel.attention(q_rot.float(), k_rot.float(), v.float(), method.parts(), inv_freq.float(), key_padding=holed, positions=positions)
    assert len(calls) == 2


def test_key_spans_over_positions_that_skip_take_the_tiled_kernel(calls):
    """DCA's chunk relations are spans of key positions, which the C++ kernel takes as key indices: where positions
    are not consecutive, auto computes the call on tiles, as backend='cpu_flash' does."""
    method = create("dca", training_window=60, chunk_size=16, local_window=4)
    q, k, v, q_rot, k_rot, positions, padding, inv_freq = case(130)
    skipping = positions.clone()
    skipping[:, 60:] += 7
    arguments = (q_rot.float(), k_rot.float(), v.float(), method.parts(), inv_freq.float())
    assert torch.equal(kernel.attention(*arguments, positions=skipping), kernel.attention(*arguments, positions=skipping, backend="cpu_flash"))
    assert not calls
    kernel.attention(*arguments, positions=positions)
    assert len(calls) == 1


def test_bfloat16_inputs_give_bfloat16_outputs_close_to_float32():
    method = create("string", training_window=200, shift=70, local_window=9)
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(1, 4, 300, 32, generator=g), torch.randn(1, 2, 300, 32, generator=g), torch.randn(1, 2, 300, 32, generator=g)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 32, 2) / 32))
    for q_len in (300, 1):
        got = kernel.attention(q[:, :, -q_len:].bfloat16(), k.bfloat16(), v.bfloat16(), method.parts(), inv_freq, backend="cpu_fused")
        want = kernel.attention(*(x.bfloat16().float() for x in (q[:, :, -q_len:], k, v)), method.parts(), inv_freq, backend="math")
        assert got.dtype == torch.bfloat16
        assert (got.float() - want).abs().max() <= 2e-2


def test_the_kernel_refuses_what_it_cannot_compute_in_one_line():
    method = create("string", training_window=60, shift=20, local_window=4)
    q, k, v, q_rot, k_rot, positions, padding, inv_freq = case(30)
    q_rot = q_rot.float().requires_grad_()
    with pytest.raises(ValueError, match="backend='cpu_fused' computes no gradients"):
        kernel.attention(q_rot, k_rot.float(), v.float(), method.parts(), inv_freq.float(), backend="cpu_fused")
    dpe = create("dpe", training_window=60, group_scales=(2, 3, 1, 4), local_window=10, top_k=5,
                 dimensions=torch.rand(1, 4, 8, generator=torch.Generator().manual_seed(3)))
    with pytest.raises(ValueError, match="no per-head rotary pairs"):
        kernel.attention(q_rot.detach(), k_rot.float(), v.float(), dpe.layer_parts(0), inv_freq.float(), backend="cpu_fused")


def test_auto_takes_the_kernel_on_the_cpu_unless_compiling_or_it_cannot_be_built(monkeypatch):
    """Gradients, DPE's per-head pairs and torch.compile take the tiled kernel; a kernel that cannot be built makes
    auto warn once and compute the same on tiles from then on."""
    cpu = torch.zeros(1, 4, 64, 16)
    assert backends.pick(cpu, "auto", fusable=True) is native.parts_attention
    assert backends.pick(cpu, "auto", fusable=False) is backends.cpu_flash
    assert backends.pick(cpu.double(), "auto", fusable=True) is backends.math_block
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert backends.pick(cpu, "auto", fusable=True) is backends.cpu_flash
    monkeypatch.undo()

    method = create("string", training_window=60, shift=20, local_window=4)
    q, k, v, q_rot, k_rot, positions, padding, inv_freq = case(50)
    arguments = (q_rot.float(), k_rot.float(), v.float(), method.parts(), inv_freq.float())
    want = kernel.attention(*arguments, backend="cpu_flash")

    def broken():
        raise native.BuildError("RuntimeError: Error building extension 'longreach_parts'")

    monkeypatch.setattr(native, "_module", broken)
    monkeypatch.setattr(native, "_build_failure", [])
    with pytest.warns(UserWarning, match="could not be built .* uses the tiled kernel") as caught:
        assert torch.equal(kernel.attention(*arguments), want)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(kernel.attention(*arguments), want)  # no second warning: auto no longer picks it
    assert len(caught) == 1
    with pytest.raises(native.BuildError):
        kernel.attention(*arguments, backend="cpu_fused")


def test_a_model_generates_the_same_tokens_with_the_kernel_and_with_the_tiled_kernel(calls):
    model = tiny_model("llama")
    x = torch.randint(3, 97, (2, 40), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(x)
    mask[1, :6] = 0  # left padding
    settings = dict(attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    outputs = {}
    for backend in ("cpu_flash", "cpu_fused"):
        longreach.apply(model, "string", backend=backend, shift=12, local_window=3)
        with torch.no_grad():
            outputs[backend] = (model(x, attention_mask=mask).logits, model.generate(x, **settings),
                                model.generate(x, cache_implementation="static", **settings))
        longreach.remove(model)
    assert (outputs["cpu_fused"][0] - outputs["cpu_flash"][0])[mask.bool()].abs().max() <= 1e-4
    assert torch.equal(outputs["cpu_fused"][1], outputs["cpu_flash"][1])
    assert torch.equal(outputs["cpu_fused"][2], outputs["cpu_flash"][2])
    assert calls

"""The CPU kernel (longreach.attention.backends.cpu_fused, built from csrc/parts.cpp and called by
longreach.attention.native) against the float64 dense reference."""

import warnings

import pytest
import torch
from helpers.cases import BASELINES, attend, case, expected
from helpers.native import native_builds

from longreach.attention import backends, kernel, native
from longreach.attention.backends import cpu_fused
from longreach.methods import create

pytestmark = pytest.mark.skipif(not cpu_fused.available("cpu"), reason="needs a C++ compiler")


def test_the_kernel_builds_where_a_compiler_is():
    """CI has a compiler: a kernel that fails to build there is a failure, not a skip (auto would fall back
    silently)."""
    assert native_builds()


METHODS = [
    ("rope", {}),
    ("string", {"shift": 40, "local_window": 5}),
    ("string", {"shift": 300, "local_window": 30, "mscale": True}),
    ("dca", {"chunk_size": 200, "local_window": 20}),  # few chunks: a decoding step turns one query per chunk
    *[(name, params) for name, params in BASELINES if name in ("rerope", "self_extend", "dca")],
]


@pytest.fixture
def calls(monkeypatch):
    """How many times the C++ kernel ran."""
    counted = []
    real = native.parts_attention
    monkeypatch.setattr(native, "parts_attention", lambda *args, **kwargs: counted.append(1) or real(*args, **kwargs))
    return counted


@pytest.mark.slow
@pytest.mark.parametrize("name, params", METHODS)
@pytest.mark.parametrize("pads", [(0, 0), (3, 29)])
def test_every_method_matches_the_reference_in_prefill_chunks_and_decoding(name, params, pads, calls):
    """700 keys: three query tiles of 256, key tiles of 512 and cut edges; GQA 4:2; left padding; prefill, a chunk
    of 40 queries, and decoding (one and five queries: query heads packed per key/value head)."""
    method = create(name, training_window=600, **params)
    n = 700
    example = case(n, pads=pads)
    q, k, v, q_rot, k_rot, positions, padding, inv_freq = example
    for q_len in (n, 40, 5, 1):
        want, rows = expected(method, q, k, v, positions, padding, inv_freq, q_len, scaling=0.3)
        got = attend(
            method,
            example,
            q_len,
            scaling=0.3,
            key_padding=padding if pads[1] else None,
            positions=positions,
            backend="auto",
        )
        assert got.dtype == torch.float32 and not got.isnan().any()
        assert (got - want)[rows].abs().max() <= 2e-5, q_len
    assert len(calls) == 4


@pytest.mark.parametrize("pad", [0, 1500])
def test_decoding_splits_the_keys_and_combines_them_exactly(pad, calls):
    """2,600 keys, one key/value head: the keys are split between tasks; with 1,500 padded keys the first split holds
    no key of the padded sequence."""
    method = create("string", training_window=2000, shift=700, local_window=50)
    example = case(2600, batch=2, q_heads=3, kv_heads=1, pads=(0, pad))
    q, k, v, q_rot, k_rot, positions, padding, inv_freq = example
    for q_len in (1, 3):
        want, rows = expected(method, q, k, v, positions, padding, inv_freq, q_len, scaling=0.3)
        key_padding = padding if pad else None
        got = attend(method, example, q_len, scaling=0.3, key_padding=key_padding, positions=positions)
        assert (got - want)[rows].abs().max() <= 2e-5
    assert len(calls) == 2


def test_a_sliding_window_partial_rotary_one_key_head_and_padding_not_on_the_left(calls):
    """The model's window cuts every part; dimensions past the rotary pairs keep their values; GQA 4:1. Padding
    with a hole is the tiled kernel's (the C++ kernel takes a first real key per sequence only)."""
    method = create("rerope", training_window=60, window=12)
    n, window = 300, 70
    example = case(n, pads=(0, 11), rotary_dims=10, kv_heads=1)
    q, k, v, q_rot, k_rot, positions, padding, inv_freq = example
    for q_len in (n, 2):
        want, rows = expected(method, q, k, v, positions, padding, inv_freq, q_len, scaling=0.3, window=window)
        got = attend(
            method,
            example,
            q_len,
            scaling=0.3,
            key_padding=padding,
            positions=positions,
            sliding_window=window,
        )
        assert (got - want)[rows].abs().max() <= 2e-5
    assert len(calls) == 2
    holed = padding.clone()
    holed[0, 50] = False
    attend(method, example, key_padding=holed, positions=positions)
    assert len(calls) == 2


@pytest.mark.parametrize("dim", [1024, 1100])
def test_a_head_wider_than_1024_is_exact(dim, calls):
    """Issue trust4, defect 5: 100 query rows read a plain plane of moved keys transposed, a key at a time, through a
    row as wide as the head (a fixed row of 1,024 floats overflowed: a segmentation fault at 1,100)."""
    method = create("rerope", training_window=60, window=12)
    example = case(100, q_heads=2, kv_heads=1, dim=dim, rotary_dims=dim)
    q, k, v, q_rot, k_rot, positions, padding, inv_freq = example
    want, rows = expected(method, q, k, v, positions, padding, inv_freq, 100, scaling=0.03)
    got = attend(method, example, scaling=0.03, positions=positions)
    assert (got - want)[rows].abs().max() <= 1e-5
    assert len(calls) == 1


def test_key_spans_over_positions_that_skip_take_the_tiled_kernel(calls):
    """DCA's chunk relations are spans of key positions, which the C++ kernel takes as key indices: where positions
    are not consecutive, auto computes the call on tiles, as backend='cpu_flash' does."""
    method = create("dca", training_window=60, chunk_size=16, local_window=4)
    q, k, v, q_rot, k_rot, positions, padding, inv_freq = case(130)
    skipping = positions.clone()
    skipping[:, 60:] += 7
    arguments = (q_rot.float(), k_rot.float(), v.float(), method.parts(), inv_freq.float())
    assert torch.equal(
        kernel.attention(*arguments, positions=skipping),
        kernel.attention(*arguments, positions=skipping, backend="cpu_flash"),
    )
    assert not calls
    kernel.attention(*arguments, positions=positions)
    assert len(calls) == 1


def test_auto_takes_the_kernel_on_the_cpu_unless_compiling_or_it_cannot_be_built(monkeypatch):
    """Gradients, DPE's per-head pairs and torch.compile take the tiled kernel; a kernel that cannot be built makes
    auto warn once and compute the same on tiles from then on."""
    cpu = torch.zeros(1, 4, 64, 16)
    assert backends.pick(cpu, "auto", fusable=True) is backends.REGISTRY["cpu_fused"]
    assert backends.pick(cpu, "auto", fusable=False) is backends.REGISTRY["cpu_flash"]
    assert backends.pick(cpu.double(), "auto", fusable=True) is backends.REGISTRY["math"]
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert backends.pick(cpu, "auto", fusable=True) is backends.REGISTRY["cpu_flash"]
    monkeypatch.undo()

    method = create("string", training_window=60, shift=20, local_window=4)
    q, k, v, q_rot, k_rot, positions, padding, inv_freq = case(50)
    arguments = (q_rot.float(), k_rot.float(), v.float(), method.parts(), inv_freq.float())
    want = kernel.attention(*arguments, backend="cpu_flash")

    def broken():
        raise native.BuildError("RuntimeError: Error building extension 'longreach_parts'")

    monkeypatch.setattr(native, "extension", broken)
    monkeypatch.setattr(cpu_fused, "_build_failure", [])
    with pytest.warns(UserWarning, match="could not be built .* uses the tiled kernel") as caught:
        assert torch.equal(kernel.attention(*arguments), want)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(kernel.attention(*arguments), want)  # no second warning: auto no longer picks it
    assert len(caught) == 1
    with pytest.raises(native.BuildError):
        kernel.attention(*arguments, backend="cpu_fused")

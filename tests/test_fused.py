"""The fused Triton kernel (longreach.attention.backends.triton) against the float64 dense reference.

Without a GPU it runs under Triton's interpreter (conftest sets ``TRITON_INTERPRET=1``); on a CUDA
machine the same tests run compiled (tests/test_cuda.py adds bfloat16 there).
"""

import pytest
import torch
from helpers.cases import BASELINES, attend, case, expected

from longreach.attention import backends
from longreach.attention.backends import triton as fused
from longreach.attention.backends.triton import launch
from longreach.methods import create

pytestmark = pytest.mark.skipif(not fused.available("cpu"), reason="needs Triton (TRITON_INTERPRET=1 on the CPU)")

EXACT = torch.float64 if fused.takes(torch.float64) else torch.float32  # tl.dot takes float64 from Triton 3.5 on
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-12}

FUSABLE = [
    ("rope", {}),
    ("string", {"shift": 40, "local_window": 5}),
    ("string", {"shift": 40, "local_window": 5, "mscale": True}),
    *[(name, params) for name, params in BASELINES if "dimensions" not in params],
]


@pytest.mark.slow
@pytest.mark.parametrize("name, params", FUSABLE)
@pytest.mark.parametrize("pads", [(0, 0), (3, 29)])
def test_every_method_matches_the_reference_in_prefill_chunks_and_decoding(name, params, pads):
    """Three key tiles of 64; GQA 4:2; left padding; one and five queries against the cache (split keys); float64 in
    prefill."""
    method = create(name, training_window=60, **params)
    n = 130
    example = case(n, pads=pads)
    q, k, v, q_rot, k_rot, positions, padding, inv_freq = example
    for q_len in (n, 1, 5):
        want, rows = expected(method, q, k, v, positions, padding, inv_freq, q_len, scaling=0.3)
        for dtype in {torch.float32, EXACT if q_len == n else torch.float32}:
            got = attend(
                method,
                example,
                q_len,
                dtype,
                scaling=0.3,
                key_padding=padding if pads[1] else None,
                positions=positions,
                backend="triton",
            )
            assert got.dtype == dtype and not got.isnan().any()
            assert (got - want)[rows].abs().max() <= TOLERANCE[dtype], (q_len, dtype)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, params", [("string", {"shift": 40, "local_window": 5}), ("dca", {"chunk_size": 16, "local_window": 4})]
)
def test_partial_rotary_a_sliding_window_and_one_key_head(name, params):
    """Dimensions past the rotary pairs keep their values (Phi-3); the model's window cuts every part; GQA 4:1."""
    method = create(name, training_window=60, **params)
    n, window = 140, 70
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
            backend="triton",
            sliding_window=window,
        )
        assert (got - want)[rows].abs().max() <= 1e-5


def test_key_splits_merge_to_the_one_pass_result(monkeypatch):
    """Flash-Decoding's splits, including splits that hold no key of a row (padding, the causal end), merge exactly."""
    method = create("rerope", training_window=60, window=12)
    example = case(200, pads=(0, 90))
    q, k, v, q_rot, k_rot, positions, padding, inv_freq = example
    want, rows = expected(method, q, k, v, positions, padding, inv_freq, 3, scaling=0.3)
    launched = []
    real_combine = launch._combine
    monkeypatch.setattr(launch, "_combine", lambda out, lse: launched.append(out.shape[0]) or real_combine(out, lse))
    for splits in (1, 2, 4):
        monkeypatch.setattr(launch, "_splits", lambda *args, splits=splits: splits)
        out = attend(method, example, 3, EXACT, scaling=0.3, key_padding=padding, positions=positions, backend="triton")
        assert (out - want)[rows].abs().max() <= TOLERANCE[EXACT]
    assert launched == [1, 2, 4]


@pytest.mark.parametrize("name, params", [("string", {"shift": 40, "local_window": 5}), ("dca", {"chunk_size": 16})])
def test_every_host_integer_the_kernel_takes_fits_int32(name, params, monkeypatch):
    """An unbounded cell's bound included: torch 2.11's Inductor cannot compile a call to a user-defined kernel with a
    Python int above int32 (``expr_fits_within_32bit`` takes it for a symbol; seen on an H100, 2026-11-27)."""
    method = create(name, training_window=60, **params)
    integers = []

    class Recorder:
        def __getitem__(self, grid):
            def run(*args, **constants):
                integers.extend(a for a in args if isinstance(a, int) and not isinstance(a, bool))

            return run

    monkeypatch.setattr(launch, "_traceable", lambda kernel: Recorder())
    attend(method, case(130), 1, torch.float64, scaling=0.3, backend="triton")
    assert len(integers) > 30 and max(integers) <= torch.iinfo(torch.int32).max


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, params", [(n, p) for n, p in FUSABLE if n in ("string", "rerope", "self_extend", "dca")]
)
def test_a_static_cache_by_position_with_slots_in_any_order(name, params):
    """A compiled decoding step's call (:func:`longreach.attention.compiled_step.attention`): distances from the slots'
    positions, read on the device -- slots rolled (the kernel's index distances would be wrong), empty slots (-2),
    left padding, a logit scale per sequence -- equal to scoring every slot with torch operations
    (``backend="math"``), for two queries; the kernel is the operator a compiled graph calls."""
    from longreach.attention import compiled_step

    method = create(name, training_window=60, **params)
    generator = torch.Generator().manual_seed(3)
    slots, pads, written = 96, (0, 7), (90, 83)
    positions = torch.full((2, slots), compiled_step.EMPTY)
    for b, (pad, count) in enumerate(zip(pads, written, strict=True)):
        positions[b, :count] = torch.arange(count) - pad  # padding: negative positions
    positions = positions.roll(-25, dims=1)  # a rolled buffer: the newest slots are not the last
    q, k, v = (torch.randn(2, h, n, 16, generator=generator) for h, n in ((4, 2), (2, slots), (2, slots)))
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    common = dict(scaling=0.3, logit_scale=torch.tensor([1.0, 1.3]))
    got = compiled_step.attention(q, k, v, method.parts(), inv_freq, positions, backend="triton", **common)
    want = compiled_step.attention(q, k, v, method.parts(), inv_freq, positions, backend="math", **common)
    assert (got - want).abs().max() <= 1e-5
    half = [x.bfloat16() for x in (q, k, v)]  # the model's dtype comes back, whatever the logit scale's
    got = compiled_step.attention(*half, method.parts(), inv_freq, positions, backend="triton", **common)
    assert got.dtype == torch.bfloat16 and (got.float() - want).abs().max() <= 0.05


def test_float64_before_triton_3_5_is_refused_in_one_line(monkeypatch):
    """Triton's ``tl.dot`` takes float64 from 3.5 on (torch 2.7's Triton is 3.3): a clear error, not a compiler's."""
    monkeypatch.setattr(fused.triton, "__version__", "3.3.1")
    method = create("string", training_window=60, shift=20, local_window=4)
    example = case(30)
    with pytest.raises(
        ValueError, match=r"^backend='triton' with float64 inputs needs Triton >= 3.5 .*3\.3\.1 is installed"
    ):
        attend(method, example, dtype=torch.float64, backend="triton")
    assert attend(method, example, backend="triton").dtype == torch.float32


def test_auto_decodes_with_the_kernel_on_cuda_only(monkeypatch):
    """The choice itself (a CUDA query is simulated: this machine has none)."""

    class CudaQuery:
        device, dtype = torch.device("cuda"), torch.bfloat16

        def __init__(self, length):
            self.shape = (1, 32, length, 128)

    monkeypatch.setattr(fused, "available", lambda device, for_auto=False: True)
    monkeypatch.setattr(backends.flex, "available", lambda device, for_auto=False: True)
    assert backends.pick(CudaQuery(1), "auto", fusable=True) is backends.REGISTRY["triton"]
    assert (
        backends.pick(CudaQuery(1), "auto", fusable=False) is backends.REGISTRY["math"]
    )  # gradients or DPE's per-head pairs
    assert backends.pick(CudaQuery(4096), "auto", fusable=True) is backends.REGISTRY["flex"]
    cpu = torch.zeros(
        1, 4, 1, 16
    )  # the CPU: the C++ kernel where it can be built (tests/test_native.py), else the tiled one
    assert (
        backends.pick(cpu, "auto", fusable=True)
        is backends.REGISTRY["cpu_fused" if backends.cpu_fused.available("cpu") else "cpu_flash"]
    )

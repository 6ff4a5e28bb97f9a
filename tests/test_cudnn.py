"""``cuda_cudnn``: whole-block causal calls of cuDNN's attention. This machine has no GPU: PyTorch's CPU flash
attention, which also returns the log-sum-exp, stands in for cuDNN, and the plan -- the same on any device -- is
checked against the float64 reference; the GPU run (bench/gpu.sh) measures the real kernel."""

import warnings

import pytest
import torch
from test_kernel import case, expected

from longreach.attention import backends, kernel
from longreach.attention.backends import cuda_cudnn
from longreach.methods import create

DISTANCE_METHODS = [
    ("rope", {}),
    ("string", {"shift": 40, "local_window": 5}),
    ("rerope", {"window": 36}),
    ("rerope", {"window": 36, "leak": 4.0}),
    ("self_extend", {"group_size": 3, "neighbor_window": 34}),
]


@pytest.fixture
def calls(monkeypatch):
    """cuDNN's calls, made by the stand-in: ``(rows, keys, causal)`` each."""
    made = []

    def stand_in(q, k, v, causal, scaling):
        assert q.shape[1] == k.shape[1]  # keys repeated per query head
        assert not causal or q.shape[2] == k.shape[2]  # causal calls are squares: top-left is bottom-right there
        made.append((q.shape[2], k.shape[2], causal))
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=causal, scale=scaling)

    monkeypatch.setattr(cuda_cudnn, "cudnn_forward", stand_in)
    monkeypatch.setattr(cuda_cudnn, "available", lambda query, for_auto=False: True)
    return made


@pytest.mark.parametrize("name, params", DISTANCE_METHODS)
@pytest.mark.parametrize("n", [120, 131])
def test_every_distance_method_is_whole_causal_blocks_equal_to_the_reference(calls, name, params, n):
    """Prefill, GQA 4:2, a last chunk cut short (131 rows): every block unmasked or causal on a square."""
    method = create(name, training_window=120, **params)
    q, k, v, q_rot, k_rot, positions, padding, inv_freq = case(n)
    want, rows = expected(method, q, k, v, positions, padding, inv_freq, n, scaling=0.3)
    got = kernel.attention(
        q_rot.float(),
        k_rot.float(),
        v.float(),
        method.parts(),
        inv_freq.float(),
        scaling=0.3,
        positions=positions,
        backend="cuda_cudnn",
    )
    assert calls and (got - want)[rows].abs().max() <= 1e-5


def test_string_at_a_third_of_the_window_is_a_few_calls_and_causal_work(calls):
    """STRING with S = n/3: a causal square and a flipped square per chunk of S - 1 rows (a short last chunk adds a
    rectangle), and one far square: 9 calls at n = 150, the work of causal attention."""
    n = 150
    method = create("string", training_window=n, shift=n // 3, local_window=8)
    q, k, v, q_rot, k_rot, positions, padding, inv_freq = case(n, batch=1)
    kernel.attention(q_rot.float(), k_rot.float(), v.float(), method.parts(), inv_freq.float(), backend="cuda_cudnn")
    assert len(calls) == 9
    assert sum(rows * keys / (2 if causal else 1) for rows, keys, causal in calls) <= 1.05 * n * n / 2  # causal's work


@pytest.mark.parametrize("what", ["padding", "dca", "decoding", "gradients", "narrow band", "a chunk"])
def test_what_would_need_a_mask_goes_to_the_next_backend_and_is_still_exact(calls, what):
    chosen = {"dca": ("dca", {"chunk_size": 40, "local_window": 6}), "narrow band": ("string", {"shift": 20})}
    name, params = chosen.get(what, ("string", {"shift": 44, "local_window": 6}))
    method = create(name, training_window=120, **params)
    q, k, v, q_rot, k_rot, positions, padding, inv_freq = case(120, pads=(0, 9) if what == "padding" else (0, 0))
    q_len = {"decoding": 1, "a chunk": 50}.get(what, 120)
    want, rows = expected(method, q, k, v, positions, padding, inv_freq, q_len, scaling=0.3)
    query = q_rot[:, :, -q_len:].float().requires_grad_(what == "gradients")
    got = kernel.attention(
        query,
        k_rot.float(),
        v.float(),
        method.parts(),
        inv_freq.float(),
        scaling=0.3,
        key_padding=padding if what == "padding" else None,
        positions=positions,
        backend="cuda_cudnn",
    )
    assert (got - want)[rows].abs().max() <= 1e-5
    assert calls == [] or what == "a chunk"  # a chunk whose band meets the first key is declined, else planned


def test_auto_takes_it_for_cuda_prefill_where_cudnn_runs(monkeypatch):
    class CudaQuery:
        device, dtype = torch.device("cuda"), torch.bfloat16

        def __init__(self, length):
            self.shape = (1, 32, length, 128)

    monkeypatch.setattr(cuda_cudnn, "available", lambda query, for_auto=False: True)
    assert backends.pick(CudaQuery(4096), "auto", fusable=True) is backends.REGISTRY["cuda_cudnn"]
    assert backends.pick(CudaQuery(1), "auto", fusable=True) is not backends.REGISTRY["cuda_cudnn"]
    monkeypatch.undo()
    with pytest.raises(ValueError, match="^backend='cuda_cudnn' needs cuDNN's attention: a CUDA device with cuDNN"):
        backends.pick(torch.zeros(1, 4, 64, 16), "cuda_cudnn")


def test_a_cudnn_failure_is_given_up_once_with_a_warning_and_the_call_computed_by_the_next(calls, monkeypatch):
    """A call cuDNN fails (here: its first) is computed again by the next backend, with one warning; auto no longer
    takes cuDNN in this process. Named outright, the failure is an error."""

    def failing(*args):
        raise RuntimeError("cuDNN Frontend error: No valid execution plans built.")

    monkeypatch.setattr(cuda_cudnn, "cudnn_forward", failing)
    monkeypatch.setattr(cuda_cudnn, "_failure", [])
    monkeypatch.setattr(cuda_cudnn, "available", lambda query, for_auto=False: not (for_auto and cuda_cudnn._failure))
    for name in ("cpu_fused", "cpu_flash"):  # this CPU query is auto's for cuDNN, as a CUDA one would be
        monkeypatch.setattr(backends.REGISTRY[name], "wants", lambda query, fusable: False)
    method = create("string", training_window=120, shift=44, local_window=6)
    q, k, v, q_rot, k_rot, positions, padding, inv_freq = case(120)
    want, rows = expected(method, q, k, v, positions, padding, inv_freq, 120, scaling=0.3)
    arguments = (q_rot.float(), k_rot.float(), v.float(), method.parts(), inv_freq.float())
    with pytest.warns(UserWarning, match="cuDNN's attention failed .*No valid execution plans"):
        got = kernel.attention(*arguments, scaling=0.3, positions=positions)
    assert (got - want)[rows].abs().max() <= 1e-5
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kernel.attention(*arguments, scaling=0.3, positions=positions)  # no second warning
    with pytest.raises(cuda_cudnn.CudnnError, match="No valid execution plans"):
        kernel.attention(*arguments, backend="cuda_cudnn")

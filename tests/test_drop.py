"""Drop Attention and Dynamic Drop Attention: the rule, the schedule, and the kernel against the reference."""

import copy

import pytest
import torch
from helpers.cases import attend, case
from helpers.memory import measure_peak_growth
from helpers.tiny_models import tiny_model

import longreach
from longreach.attention import kernel, reference, whole_rows
from longreach.methods import create
from longreach.methods.drop import Drop, DynamicDrop

NEG = float("-inf")


def test_drop_rule_on_hand_made_rows():
    scores = torch.tensor([[[[3.0, 1.0, 5.0, 2.0, 4.0, NEG]]]])  # 5 attendable keys, one masked

    def kept(rate):
        return torch.isfinite(whole_rows.drop_below_quantile(scores, torch.tensor([[rate]])))[0, 0, 0].tolist()

    assert kept(0.0) == [True, True, True, True, True, False]
    assert kept(0.5) == [True, False, True, False, True, False]  # k = ceil(0.5 * 4) = 2: keep >= 3
    assert kept(0.3) == [True, False, True, False, True, False]  # k = ceil(1.2) = 2, as torch.quantile
    assert kept(0.25) == [True, False, True, True, True, False]  # k = 1 exactly: keep >= 2
    assert kept(0.99) == [False, False, True, False, False, False]  # the best key always survives
    assert torch.quantile(torch.tensor([3.0, 1, 5, 2, 4]), 0.3) > 2.0  # the same cut as torch.quantile


def test_ties_at_the_quantile_are_kept_and_empty_rows_stay_empty():
    scores = torch.tensor([[[[2.0, 2.0, 2.0, 1.0], [NEG, NEG, NEG, NEG]]]])
    out = whole_rows.drop_below_quantile(scores, torch.tensor([[0.6, 0.6]]))
    assert torch.isfinite(out[0, 0, 0]).tolist() == [True, True, True, False]
    assert torch.isneginf(out[0, 0, 1]).all()


def test_dynamic_drop_schedule():
    dda = DynamicDrop(initial_rate=0.15, step=0.05, max_rate=0.3, chunk=1000)
    positions = torch.tensor([[0, 8191, 8192, 9191, 9192, 10192, 11192, 20000]])
    schedule = [0, 0, 0.15, 0.15, 0.2, 0.25, 0.3, 0.3]
    assert dda.rates(positions, 8192, generated=None)[0].tolist() == pytest.approx(schedule)
    assert dda.rates(positions, 8192, generated=torch.ones(1, 8, dtype=torch.bool)).tolist() == [[0.0] * 8]
    last = torch.tensor([[False] * 7 + [True]])  # the prompt's tokens keep the schedule, the generated one its rate
    assert DynamicDrop(generated_rate=0.1).rates(positions, 8192, generated=last)[0].tolist() == pytest.approx(
        [*schedule[:7], 0.1]
    )
    assert Drop(rate=0.3).rates(positions, 8192, generated=last)[0, -1] == pytest.approx(0.3)


@pytest.mark.parametrize(
    "name, params",
    [("rope", {}), ("string", {"shift": 12, "local_window": 3}), ("dca", {"chunk_size": 16, "local_window": 4})],
)
@pytest.mark.parametrize("pads", [(0, 0), (0, 7)])
def test_dropped_kernel_matches_the_reference(name, params, pads):
    method = create(name, training_window=40, **params)
    example = case(57, pads=pads)
    q, k, v, q_rot, k_rot, positions, padding, inv_freq = example
    for q_len in (57, 1):
        rates = torch.rand(2, q_len, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 0.6
        P = method.relative_positions(positions[:, -q_len:, None], positions[:, None, :])
        want = reference.dense_attention(
            q[:, :, -q_len:], k, v, P, inv_freq, 0.3, key_padding=padding, drop_rates=rates
        )
        got = attend(
            method,
            example,
            q_len,
            scaling=0.3,
            key_padding=padding if pads[1] else None,
            positions=positions,
            drop=rates,
            tile=16,
        )
        rows = padding[:, -q_len:]
        assert (got - want)[rows].abs().max() <= 1e-5


@pytest.mark.parametrize("family", ["llama", "gemma3", "phi3"])
@pytest.mark.parametrize(
    "spec",
    [
        {"method": "drop", "rate": 0.3, "layers": (0, 1)},
        {"method": "dynamic_drop", "initial_rate": 0.1, "step": 0.1, "max_rate": 0.35, "chunk": 8, "layers": (1,)},
    ],
)
@torch.no_grad()
def test_drop_methods_equal_the_reference_on_tiny_models(family, spec):
    window = {"original_max_position_embeddings": 40} if family == "phi3" else {}
    model, x = tiny_model(family, max_position_embeddings=40, **window), torch.randint(3, 97, (1, 70))
    assert longreach.training_window(model.config) == 40
    spec = dict(spec)
    name = spec.pop("method")
    stock = model(x).logits
    longreach.apply(model, name, **spec)
    ours = model(x).logits.double()
    model.double()
    longreach.apply(model, name, backend="reference", **spec)
    assert (ours - model(x, position_ids=torch.arange(70)[None]).logits).abs().max() <= 1e-4
    assert (ours - stock.double()).abs().max() > 1e-3  # dropping changes the output


@torch.no_grad()
def test_drop_composes_and_only_touches_its_layers():
    model, x = tiny_model("llama", max_position_embeddings=40, num_hidden_layers=3), torch.randint(3, 97, (1, 60))
    longreach.apply(model, "string", shift=12, local_window=3)
    plain = model(x, output_hidden_states=True).hidden_states
    longreach.apply(model, "string", shift=12, local_window=3, drop={"method": "drop", "rate": 0.4, "layers": [2]})
    dropped = model(x, output_hidden_states=True).hidden_states
    assert all(torch.equal(a, b) for a, b in zip(plain[:3], dropped[:3], strict=True))  # layers 0 and 1 untouched
    assert not torch.allclose(plain[3], dropped[3])
    assert "drop(rate=0.4, layers=[2])" in longreach.describe(model)


def test_a_forward_computes_the_rates_and_reads_the_first_dropping_row_once_for_all_its_dropping_layers(monkeypatch):
    """Finding the first dropping row reads the device (a sync on CUDA): once per forward pass, not per layer."""
    model, x = tiny_model("llama", max_position_embeddings=40, num_hidden_layers=3), torch.randint(3, 97, (1, 60))
    longreach.apply(model, "drop", rate=0.4, layers=(0, 1, 2))
    reads, real = [], kernel.first_dropping_row
    monkeypatch.setattr(kernel, "first_dropping_row", lambda drop: reads.append(drop) or real(drop))
    with torch.no_grad():
        model(x)
        assert len(reads) == 1
        model(x)
    assert len(reads) == 2 and reads[0] is not reads[1]  # a new pass reads again


@torch.no_grad()
def test_generated_tokens_use_the_generated_rate():
    """With DDA (generated_rate 0) a generated token drops nothing; with DA every step drops. A decoding loop of
    one's own declares its prompt (generate does it by itself); undeclared, a token is prompt text."""
    from longreach.integrations.recording import generation

    model, x = tiny_model("qwen2", max_position_embeddings=40), torch.randint(3, 97, (1, 60))

    def prompt_logits():
        return model(x, use_cache=True)

    def step(cache):
        return model(torch.tensor([[5]]), past_key_values=cache).logits

    longreach.apply(model, "rope")
    cache = prompt_logits().past_key_values
    step_plain = step(cache)
    longreach.apply(model, "dynamic_drop", chunk=4, layers=(0, 1))
    with generation(torch.tensor([60])):
        step_dda = step(prompt_logits().past_key_values)
    longreach.apply(model, "rope")
    cache_plain = prompt_logits().past_key_values
    longreach.apply(model, "dynamic_drop", chunk=4, layers=(0, 1))
    with generation(torch.tensor([60])):
        assert torch.allclose(step(copy.deepcopy(cache_plain)), step_plain, atol=1e-6)
    assert not torch.allclose(step(cache_plain), step_plain, atol=1e-4)  # undeclared: position 60's prompt rate
    assert not torch.allclose(step_dda, step_plain, atol=1e-4)  # the prompt itself was dropped
    longreach.apply(model, "drop", rate=0.5, layers=(0, 1))
    cache_plain = (longreach.apply(model, "rope") and prompt_logits()).past_key_values
    longreach.apply(model, "drop", rate=0.5, layers=(0, 1))
    with generation(torch.tensor([60])):
        assert not torch.allclose(step(cache_plain), step_plain, atol=1e-4)


@pytest.mark.parametrize(
    "params, message",
    [
        ({"method": "drop", "rate": 1.0}, "rate=1.0 is out of range: 0 <= rate < 1"),
        ({"method": "drop", "layers": (0, 9)}, r"layers=\[0, 9\] is out of range: layer indices 0 .. 1"),
        ({"method": "drop", "layers": ()}, "layers=.* is out of range: a non-empty list"),
        (
            {"method": "dynamic_drop", "initial_rate": 0.3, "max_rate": 0.2},
            "max_rate=0.2 is out of range: initial_rate = 0.3",
        ),
        ({"method": "dynamic_drop", "chunk": 0}, "chunk=0 is out of range: an integer >= 1"),
        ({"method": "dynamic_drop", "step": -0.1}, "step=-0.1 is out of range: step >= 0"),
        ({"method": "sparse"}, "unknown drop method 'sparse'"),
    ],
)
def test_bad_drop_parameters_are_clear_errors(params, message):
    with pytest.raises(ValueError, match=message):
        longreach.apply(tiny_model("llama"), "rope", drop=params)


@pytest.mark.parametrize("method", ["drop", "dynamic_drop"])
def test_the_default_layers_fit_a_model_of_fewer_than_three(method):
    """The paper's first three layers: on a 2-layer model, its two (the review: ``layers=[0, 1, 2] is out of range``,
    a parameter the user never gave)."""
    model = tiny_model("llama")
    longreach.apply(model, method)
    assert model.config.num_hidden_layers == 2 and "layers=[0, 1])" in longreach.describe(model)
    from longreach.methods.drop import in_model

    assert in_model({"rate": 0.1}, 30) == {"rate": 0.1, "layers": (0, 1, 2)}


MEMORY_PROBE = """
import resource, torch
from longreach.attention import kernel
from longreach.methods import create
n = 16384
q, k, v = (torch.randn(1, 1, n, 64) for _ in range(3))
inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))
rates = torch.full((1, n), 0.3, dtype=torch.float64)
parts = create("string", training_window=n).parts()
kernel.attention(q[:, :, :300], k[:, :, :300], v[:, :, :300], parts, inv_freq, drop=rates[:, :300])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
kernel.attention(q, k, v, parts, inv_freq, drop=rates)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


@pytest.mark.slow
def test_dropped_attention_memory_at_16k_stays_bounded():
    """Rows are computed a tile at a time: far below the 1 GiB of one 16,384^2 float32 matrix."""
    grown = measure_peak_growth(MEMORY_PROBE)
    assert grown < (1 << 30) // 16, f"peak memory grew by {grown / 2**20:.0f} MiB"


GROWTH_PROBE = """
import resource, sys, torch
from longreach.attention import kernel
from longreach.methods import create
n, train = int(sys.argv[1]), sys.argv[2] == "train"
torch.manual_seed(0)
q, k, v = (torch.randn(1, 4, n, 64, requires_grad=train) for _ in range(3))
inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))
rates = torch.full((1, n), 0.3, dtype=torch.float64)
parts = create("string", training_window=n).parts()
head = [x[:, :, :300].detach() for x in (q, k, v)]
kernel.attention(*head, parts, inv_freq, drop=rates[:, :300])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
with torch.set_grad_enabled(train):
    out = kernel.attention(q, k, v, parts, inv_freq, drop=rates)
    if train:
        out.square().sum().backward()
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


@pytest.mark.slow
@pytest.mark.parametrize("mode, n, bound", [("prefill", 8192, 8), ("train", 4096, 16)])
def test_dropped_attention_memory_stays_linear_as_a_user_sees_it(mode, n, bound):
    """With the allocator as it is (no fixed mmap threshold), peak growth within a few times the inputs. The
    review measured n^2 growth in prefill (heap fragmentation from tiles of ever new widths: 466 MB here at
    8K, 18.6x the inputs; 3.4 GB at 32K) and in training (autograd kept every tile's probabilities: 590 MB
    here at 4K, 47x the inputs). After: 3.1x and 6.2x. (Free heap left by the warm-up can only lower a reading.)"""
    grown = measure_peak_growth(f"import sys; sys.argv = ['', '{n}', '{mode}']\n" + GROWTH_PROBE, live_only=False)
    inputs = 3 * 4 * n * 64 * 4
    assert grown < bound * inputs, f"{mode} at {n}: {grown / 2**20:.0f} MiB, {grown / inputs:.1f}x the inputs"

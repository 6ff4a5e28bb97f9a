import pytest
import torch
from helpers.tiny_models import text_model

import longreach
from longreach.analysis import dispersion
from longreach.eval import haystack


@pytest.fixture(scope="module")
def setup():
    return (*text_model(window=200), haystack.essays())


@pytest.mark.slow
def test_probe_matches_dense_probabilities_and_restores_the_model(setup):
    model, tokenizer, text = setup
    result = dispersion.measure(model, tokenizer, text, 300, points=4, top_k=1)
    assert longreach.applied(model) is None  # the temporary rope is removed
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"][:, :300]
    model.set_attn_implementation("eager")
    with torch.no_grad():
        attentions = model(ids, output_attentions=True).attentions  # [B, H, n, n], eager
    model.set_attn_implementation("sdpa")
    for layer, values in result["layers"].items():
        dense = attentions[layer][0].max(-1).values.mean(0)[result["positions"]]
        assert torch.allclose(torch.tensor(values), dense, atol=1e-5)


@pytest.mark.slow
def test_dropping_sharpens_attention_beyond_the_window(setup, tmp_path):
    """In the first dropped layer (same input), dropping keys can only raise the kept probabilities."""
    model, tokenizer, text = setup
    plain = dispersion.measure(model, tokenizer, text, 600, points=8, top_k=3)
    longreach.apply(model, "dynamic_drop", chunk=50, initial_rate=0.3, step=0.2, max_rate=0.9, layers=(0, 1))
    dropped = dispersion.measure(model, tokenizer, text, 600, points=8, top_k=3)
    longreach.remove(model)
    for position, a, b in zip(plain["positions"], plain["layers"][0], dropped["layers"][0], strict=True):
        assert b == pytest.approx(a, abs=1e-7) if position < 200 else b > a
    picture = dispersion.plot({"rope": plain, "dynamic_drop": dropped}, tmp_path / "d.png", window=200)
    assert picture.stat().st_size > 0


def test_probe_errors(setup):
    model, tokenizer, text = setup
    with pytest.raises(ValueError, match="length=99999999 is out of range: the text has only"):
        dispersion.measure(model, tokenizer, text[:1000], 99999999)
    with pytest.raises(ValueError, match="top_k=0 is out of range"):
        dispersion.measure(model, tokenizer, text, 100, top_k=0)

"""Every family in transformers' registry of causal language models: exact against the float64 reference under every
position method and YaRN, or refused in one line (longreach/integrations/families.py classifies each).

A verified family's tiny random model (tests/helpers/registry_models.py) runs each method on a left-padded batch of
two sequences: its prefill logits, and the tokens and logits of four greedy decoding steps with the dynamic and with
the static cache, must equal those of the same model under the dense float64 reference (backend="reference"), which
turns each layer's pairs where its layout says. A family that transformers adds fails here until it is classified.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch
from helpers.registry_models import tiny_registry_model
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import longreach
from longreach.integrations import families

REGISTRY = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
METHODS = {  # tiny models: 40 tokens, so that every method's regions are all crossed
    "string": dict(shift=20, local_window=4),
    "rerope": dict(window=30, leak=2.0),
    "self_extend": dict(group_size=3, neighbor_window=16),
    "dca": dict(chunk_size=30, local_window=6),
    "dpe": dict(group_scales=(2, 3), local_window=12, top_k=None),
    "yarn": dict(factor=2.0),
}
LENGTH, PADDING, STEPS = 40, 12, 4
TOLERANCE = 1e-4  # the logits' largest difference (float32 kernels against float64 attention), relative to them
MEASURED: dict[str, dict[str, str]] = {}  # family -> method -> "exact" or the refusal, for the docs' table
WORST: dict[str, float] = {}  # family -> the largest relative difference from the reference, under any method
DOCS = Path(__file__).parents[1] / "docs" / "methods.md"


def test_every_family_in_the_registry_is_classified():
    unclassified = [name for name in REGISTRY if name not in families.VERIFIED and name not in families.REFUSED]
    assert not unclassified, (
        f"transformers' registry has families longreach has not classified: {', '.join(unclassified)}; run them "
        "here as verified (longreach/integrations/families.py's VERIFIED) or give the reason each is refused (REFUSED)"
    )
    assert not set(families.VERIFIED) & set(families.REFUSED)


@pytest.mark.parametrize("model_type", [name for name in REGISTRY if name in families.REFUSED])
def test_a_refused_family_is_refused_in_one_line_before_anything_changes(model_type):
    with pytest.raises(ValueError, match=re.escape(families.REFUSED[model_type])):
        families.classify(model_type)
    try:
        model = tiny_registry_model(model_type)
    except Exception:  # NOT_BUILT: no model to apply to; the classification above is what apply reads
        return
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError) as refused:
        longreach.apply(model, "string", **METHODS["string"])
    assert "\n" not in str(refused.value) and len(str(refused.value)) < 400
    assert longreach.applied(model) is None
    assert all(torch.equal(before[name], value) for name, value in model.state_dict().items())


FAST = {"llama", "glm4", "deepseek_v3", "smollm3", "cohere2", "gemma3_text"}  # one per layout: make test-fast


@pytest.mark.parametrize(
    "model_type",
    [
        pytest.param(name, marks=() if name in FAST else pytest.mark.slow)
        for name in REGISTRY
        if name in families.VERIFIED
    ],
)
@torch.no_grad()
def test_a_verified_family_is_exact_under_every_method_or_refuses_it_in_one_line(model_type):
    stock = tiny_registry_model(model_type)
    results = MEASURED.setdefault(model_type, {})
    effects, worst = {}, {}
    for method, params in METHODS.items():
        model = copy.deepcopy(stock)
        try:
            longreach.apply(model, method, **params)
        except ValueError as refused:
            assert "\n" not in str(refused) and longreach.applied(model) is None
            results[method] = f"refused: {refused}"
            continue
        errors, effects[method] = _errors_against_the_reference(stock, model, method, params, method == "string")
        worst[method] = max(errors.values())
        assert worst[method] <= TOLERANCE, f"{model_type} under {method}: {errors}"
        results[method] = "exact"
    WORST[model_type] = max(worst.values())
    assert results["string"] == "exact", f"{model_type}: STRING is refused: {results['string']}"
    # a test that could fail: STRING moves the logits far more than the error
    assert effects["string"] > max(10 * TOLERANCE, 100 * worst["string"]), f"{model_type}: {effects}, {worst}"


def _inputs(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, min(vocab, 97), (2, LENGTH), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :PADDING] = 0
    ids[1, :PADDING] = 0
    return ids, mask


def _positions(mask: torch.Tensor) -> torch.Tensor:
    return (mask.cumsum(-1) - 1).clamp(min=0)


def _errors_against_the_reference(stock, model, method: str, params: dict, effect: bool) -> tuple[dict, float]:
    """The largest logit differences from the float64 reference, in prefill and in each cache's decoding steps
    (against the reference's own decoding steps: a hybrid model's recurrent layers decode otherwise than they
    prefill), and (with ``effect``) how far the method moves the prefill logits from the stock model's; all relative
    to the largest logit."""
    ids, mask = _inputs(stock.config.get_text_config(decoder=True).vocab_size)
    steps = dict(max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False, output_logits=True)
    reference = copy.deepcopy(stock)
    longreach.apply(reference, method, backend="reference", **params)
    expected = reference(ids, attention_mask=mask, position_ids=_positions(mask)).logits.double()
    expected_steps = reference.generate(ids, attention_mask=mask, return_dict_in_generate=True, **steps)
    scale = expected[mask.bool()].abs().max().item()
    prefill = model(ids, attention_mask=mask, position_ids=_positions(mask)).logits.double()
    errors = {"prefill": (prefill - expected)[mask.bool()].abs().max().item() / scale}
    for cache in ("dynamic", "static"):
        generated = model.generate(
            ids, attention_mask=mask, return_dict_in_generate=True, cache_implementation=cache, **steps
        )
        assert torch.equal(generated.sequences, expected_steps.sequences), f"{cache} cache: other tokens"
        logits, wanted = (torch.stack(g.logits, dim=1).double() for g in (generated, expected_steps))
        errors[f"{cache} cache"] = (logits - wanted).abs().max().item() / scale
    if not effect:
        return errors, 0.0
    stock_logits = stock(ids, attention_mask=mask, position_ids=_positions(mask)).logits.double()
    return errors, (expected - stock_logits)[mask.bool()].abs().max().item() / scale


def test_the_docs_families_table_is_the_one_measured():
    """docs/methods.md's table of families says what the test above measured, row for row."""
    verified = [name for name in REGISTRY if name in families.VERIFIED]
    if any(name not in MEASURED for name in verified):
        pytest.skip("the families test above did not run every verified family in this session")
    table = families_table()
    print(table)
    print("largest relative difference from the reference:", max(WORST.values()), max(WORST, key=WORST.get))
    assert table in DOCS.read_text(), f"docs/methods.md's families table is not the one measured; it is now:\n{table}"


def families_table() -> str:
    """The verified families as measured: each one's layout and what each method did on it."""
    rows = [
        "| family | RoPE layout | layers without RoPE | exact under | refused in one line |",
        "|---|---|---|---|---|",
    ]
    for name in sorted(MEASURED):
        family = families.VERIFIED[name]
        exact = [method for method, result in MEASURED[name].items() if result == "exact"]
        refused = [
            f"{method} ({_short(name, result)})" for method, result in MEASURED[name].items() if result != "exact"
        ]
        rows.append(
            f"| {name} | {family.describe()} | {families.RULES[family.rotates]} | {', '.join(exact)} "
            f"| {'; '.join(refused) or '-'} |"
        )
    return "\n".join(rows)


def _short(name: str, refusal: str) -> str:
    """A refusal's reason without the family's name and the advice: what the table has room for."""
    return refusal.removeprefix("refused: ").removeprefix(f"{name}: ").split("; ")[0]


def test_the_docs_say_why_each_refused_family_is_refused():
    table = refused_table()
    assert table in DOCS.read_text(), f"docs/methods.md's table of refused families is not this one:\n{table}"


def refused_table() -> str:
    """The refused families of the registry, grouped by the reason ``apply`` gives."""
    reasons: dict[str, list[str]] = {}
    for name in REGISTRY:
        if name in families.REFUSED:
            reasons.setdefault(families.REFUSED[name], []).append(name)
    rows = ["| refused because | families |", "|---|---|"]
    rows += [
        f"| {reason} | {', '.join(names)} |" for reason, names in sorted(reasons.items(), key=lambda r: -len(r[1]))
    ]
    return "\n".join(rows)

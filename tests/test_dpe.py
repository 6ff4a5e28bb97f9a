"""DPE: its rule, its parts, per-head pairs in models of several families, its parameters and errors."""

import pytest
import torch
from helpers.tiny_models import tiny_model
from safetensors.torch import save_file

import longreach
from longreach.attention import heads, kernel
from longreach.attention.rotary import rotary_pairs
from longreach.integrations.rotary_embedding import find_rotary
from longreach.methods import create


def dense(method, n):
    positions = torch.arange(n)
    return method.relative_positions(positions[:, None], positions[None, :])


def test_worked_entries_of_the_rule():
    """w = 4, scales (2, 3): r < w keeps r; beyond, i // s - j // s + w - w // s per group."""
    P = dense(create("dpe", training_window=16, group_scales=(2, 3), local_window=4, top_k=None), 12)
    assert P[3, 0].tolist() == [3, 3]  # r = 3 < w
    assert P[9, 0].tolist() == [9 // 2 + 4 - 2, 9 // 3 + 4 - 1]  # [6, 6]
    assert P[11, 2].tolist() == [11 // 2 - 1 + 2, 11 // 3 - 0 + 3]  # [6, 6]
    assert P[10, 5].tolist() == [5 - 2 + 2, 3 - 1 + 3]  # [5, 5]
    assert torch.isnan(P[2, 5]).all()  # not attended
    # scale 1 is RoPE itself
    assert torch.equal(
        dense(create("dpe", training_window=16, group_scales=(1,), local_window=4, top_k=None), 12)[..., 0].nan_to_num(
            -1
        ),
        dense(create("rope", training_window=16), 12).nan_to_num(-1),
    )


@pytest.mark.parametrize("n", [6, 31])
def test_parts_cover_the_causal_triangle_once_with_each_groups_position(n):
    method = create("dpe", training_window=16, group_scales=(2, 3, 1, 5), local_window=4, top_k=None)
    P = dense(method, n)  # [n, n, G]
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    d = i - j
    covered = torch.zeros(n, n, dtype=torch.long)
    for part in method.parts():
        inside = (d >= part.min_distance) & ((d < part.max_distance) if part.max_distance else True)
        covered += inside.long()

        def shift(s, p):
            return s(p.double()[None])[0] if callable(s) else torch.zeros(*p.shape, 1, dtype=torch.float64)  # [n, G]

        q = i[..., None] + shift(part.query_shift, torch.arange(n))[:, None, :]  # [n, 1, G]
        k = j[..., None] + shift(part.key_shift, torch.arange(n))[None, :, :]  # [1, n, G]
        seen = (q - k).expand(n, n, 4)
        assert torch.equal(P[inside], seen[inside])
    assert torch.equal(covered, (d >= 0).long())


def importance_for(model, seed=0):
    text = model.config.get_text_config()
    shape = (text.num_hidden_layers, text.num_attention_heads, rotary_pairs(find_rotary(model)))
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3", "phi3", "qwen3"])
@torch.no_grad()
def test_selected_pairs_per_head_equal_the_reference_and_batch_like_single_sequences(family):
    """Per-layer, per-head pairs (GQA 4:2, and MHA on Phi-3), left padding, and generation with the cache."""
    model = tiny_model(family)
    pairs = rotary_pairs(find_rotary(model))
    params = dict(
        group_scales=(2, 3, 1, 4), local_window=12, top_k=max(1, pairs // 2), dimensions=importance_for(model)
    )
    long, short = torch.randint(3, 97, (1, 70)), torch.randint(3, 97, (1, 41))
    batch = torch.cat([long, torch.cat([torch.zeros(1, 29, dtype=torch.long), short], dim=1)])
    mask = torch.ones_like(batch)
    mask[1, :29] = 0
    longreach.apply(model, "dpe", **params)
    logits = model(batch, attention_mask=mask).logits.double()
    rope = tiny_model(family)
    assert (logits[0] - rope(long).logits[0].double()).abs().max() > 1e-3  # beyond w the positions differ
    reference = tiny_model(family, dtype=torch.float64)
    longreach.apply(reference, "dpe", backend="reference", **params)
    want = reference(batch, attention_mask=mask).logits
    assert (logits - want)[mask.bool()].abs().max() <= 1e-5
    assert (logits[1, 29:] - model(short).logits[0]).abs().max() <= 1e-5
    generated = model.generate(batch, attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    alone = model.generate(short, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert torch.equal(generated[1, 70:], alone[0, 41:])


@torch.no_grad()
def test_other_pairs_change_other_logits_and_top_k_picks_the_most_important():
    model = tiny_model("llama")
    importance = importance_for(model)
    method = create(
        "dpe", training_window=96, group_scales=(2, 2, 4, 4), local_window=8, top_k=3, dimensions=importance
    )
    chosen = method.layer_parts(1)[1].pairs  # [heads, pairs]
    assert torch.equal(chosen.sum(-1), torch.full((4,), 3))
    assert bool(
        (importance[1][chosen].view(4, 3).min(-1).values >= importance[1][~chosen].view(4, 5).max(-1).values).all()
    )
    x = torch.randint(3, 97, (1, 60))
    outputs = []
    for dimensions in (importance, 1 - importance):
        longreach.apply(model, "dpe", group_scales=(2, 2, 4, 4), local_window=8, top_k=3, dimensions=dimensions)
        outputs.append(model(x).logits)
    assert (outputs[0] - outputs[1]).abs().max() > 1e-3


def test_keys_are_repeated_per_query_head_only_in_prefill_and_only_when_a_group_disagrees(monkeypatch):
    """Decoding steps put the moved and the plain keys side by side instead (shifts.augmented)."""
    repeats = []
    expand = heads.expand_heads
    monkeypatch.setattr(kernel, "expand_heads", lambda x, heads: repeats.append(heads) or expand(x, heads))
    q, k, v = torch.randn(1, 4, 30, 16), torch.randn(1, 2, 30, 16), torch.randn(1, 2, 30, 16)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2) / 16))
    agreeing = torch.tensor([[1, 0, 1, 1, 0, 0, 1, 0], [0, 1, 1, 0, 1, 1, 0, 0]], dtype=torch.bool).repeat_interleave(
        2, 0
    )[None]
    for dimensions, q_len, expected in (
        (agreeing, 30, []),
        (torch.rand(1, 4, 8), 30, [4, 4]),
        (torch.rand(1, 4, 8), 1, []),
    ):
        repeats.clear()
        method = create("dpe", training_window=40, group_scales=(2, 4), local_window=5, top_k=4, dimensions=dimensions)
        kernel.attention(q[:, :, -q_len:], k, v, method.layer_parts(0), inv_freq)
        assert repeats == expected


@torch.no_grad()
def test_dimensions_from_a_calibration_file(tmp_path):
    model = tiny_model("llama")
    importance = importance_for(model)
    save_file({"importance": importance}, str(tmp_path / "dimensions.safetensors"))
    x = torch.randint(3, 97, (1, 50))
    longreach.apply(model, "dpe", group_scales=(2, 3, 1, 4), local_window=10, top_k=4, dimensions=importance)
    from_tensor = model(x).logits
    longreach.apply(
        model,
        "dpe",
        group_scales=(2, 3, 1, 4),
        local_window=10,
        top_k=4,
        dimensions=str(tmp_path / "dimensions.safetensors"),
    )
    assert torch.equal(model(x).logits, from_tensor)
    assert "dimensions=dimensions.safetensors@" in longreach.describe(
        model
    )  # saved with the model: test_caches_and_calls


@torch.no_grad()
def test_a_saved_dpe_model_carries_its_selection_not_the_files_path(tmp_path):
    """The review: loaded from elsewhere it failed; after a new calibration into the same file it silently changed."""
    import json
    import shutil

    from helpers.tiny_models import byte_tokenizer

    model, x = tiny_model("llama"), torch.randint(3, 97, (1, 50))
    calibration = tmp_path / "calibration" / "dimensions.safetensors"
    calibration.parent.mkdir()
    save_file({"importance": importance_for(model)}, str(calibration))
    longreach.apply(model, "dpe", group_scales=(2, 3, 1, 4), local_window=10, top_k=4, dimensions=str(calibration))
    want, described = model(x).logits, longreach.describe(model)
    model.save_pretrained(tmp_path / "saved")
    byte_tokenizer().save_pretrained(tmp_path / "saved")
    save_file({"importance": 1 - importance_for(model)}, str(calibration))  # calibrated again into the same file
    shutil.move(tmp_path / "saved", tmp_path / "moved")
    loaded, _ = longreach.load(str(tmp_path / "moved"))
    assert torch.equal(loaded(x).logits, want) and longreach.describe(loaded) == described
    calibration.unlink()
    assert torch.equal(longreach.load(str(tmp_path / "moved"))[0](x).logits, want)
    config = json.loads((tmp_path / "moved" / "config.json").read_text())
    selected = config["longreach"]["params"]["dimensions"]
    assert selected["file"] == "dimensions.safetensors" and selected["shape"] == [2, 4, 8]
    selected["sha256"] = "0" * 64  # edited by hand
    (tmp_path / "moved" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="does not match its sha256"):
        longreach.load(str(tmp_path / "moved"))


@torch.no_grad()
def test_dpe_composes_with_drop_attention():
    model = tiny_model("llama", dtype=torch.float64)
    params = dict(
        group_scales=(2, 3, 1, 4),
        local_window=10,
        top_k=4,
        dimensions=importance_for(model),
        drop={"method": "drop", "rate": 0.3, "layers": (0,)},
    )
    x = torch.randint(3, 97, (1, 45))
    longreach.apply(model, "dpe", backend="reference", **params)
    want = model(x).logits
    longreach.apply(model, "dpe", **params)
    assert (model(x).logits - want).abs().max() <= 1e-8


@pytest.mark.parametrize(
    "params, message",
    [
        (dict(), r"dpe needs group_scales .*longreach calibrate dpe"),
        (dict(group_scales=(2, 0)), r"group_scales=0 is out of range"),
        (dict(group_scales=(2, 2), local_window=0), r"local_window=0 is out of range"),
        (dict(group_scales=(2, 2)), r"top_k=48 changes the most important pairs, which needs dimensions="),
        (dict(group_scales=(2, 2), top_k=9, dimensions=torch.rand(2, 4, 8)), r"top_k=9 is out of range: 1 \.\. 8"),
        (
            dict(group_scales=(2, 2), top_k=3, dimensions=torch.ones(2, 4, 8, dtype=torch.bool)),
            r"mask with 8\.\.8 pairs per head, not top_k=3",
        ),
        (
            dict(group_scales=(2, 2), top_k=3, dimensions=torch.rand(4, 8)),
            r"\[layers, heads, pairs\] tensor, got shape \(4, 8\)",
        ),
        (dict(group_scales=(2, 2), top_k=3, dimensions="no/such/file.safetensors"), r"is not a file"),
    ],
)
def test_bad_parameters_name_the_parameter(params, message):
    with pytest.raises(ValueError, match=message):
        create("dpe", training_window=96, **params)


@pytest.mark.parametrize(
    "params, message",
    [
        (dict(group_scales=(2, 2, 2), top_k=None), r"3 groups, which do not split this model's 8 rotary pairs"),
        (
            dict(group_scales=(2, 2), top_k=2, dimensions=torch.rand(3, 4, 8)),
            r"shape \(3, 4, 8\); this model needs .* \[2, 4, 8\]",
        ),
    ],
)
def test_a_model_of_another_shape_is_refused_at_apply(params, message):
    with pytest.raises(ValueError, match=message):
        longreach.apply(tiny_model("llama"), "dpe", **params)


def test_a_file_that_is_not_safetensors_is_one_clear_error(tmp_path):
    (tmp_path / "bad.safetensors").write_text("not a tensor file")
    with pytest.raises(ValueError, match=r"is not a safetensors file"):
        create("dpe", training_window=96, group_scales=(2, 2), top_k=2, dimensions=str(tmp_path / "bad.safetensors"))

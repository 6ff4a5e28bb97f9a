"""`longreach tune` and `longreach calibrate dpe` end to end on tiny models, and their pieces."""

import json
from pathlib import Path

import pytest
import torch
from helpers.tiny_models import text_model
from safetensors.torch import load_file

import longreach
from longreach import cli
from longreach.eval import report, runner
from longreach.integrations.recording import pair_importance
from longreach.methods.spec import MethodSpec
from longreach.tuning import calibrate, tune


def test_grids_parse_and_expand_with_clear_errors():
    grid = tune.parse_grid(["shift=100,200", "local_window=8,16"])
    assert grid == {"shift": [100, 200], "local_window": [8, 16]}
    labels = [spec.label for spec in tune.settings("string", grid, {"mscale": True})]
    assert labels == [
        "string:local_window=8,mscale=True,shift=100",
        "string:local_window=16,mscale=True,shift=100",
        "string:local_window=8,mscale=True,shift=200",
        "string:local_window=16,mscale=True,shift=200",
    ]
    assert MethodSpec.parse(labels[1]).label == labels[1]  # labels read back as they are written
    for items, message in (
        (["shift"], "must look like name=value1,value2"),
        (["shift=1", "shift=2"], "names 'shift' twice"),
        ([], "empty"),
    ):
        with pytest.raises(ValueError, match=message):
            tune.parse_grid(items)
    with pytest.raises(ValueError, match="shift is both fixed and in the grid"):
        tune.settings("string", {"shift": [1]}, {"shift": 2})


def cases(*scores):
    return {(0.5, seed): score for seed, score in enumerate(scores)}


def test_the_best_setting_and_the_ones_it_cannot_be_told_from():
    rows = [
        tune.Row("a", {"shift": 1}, cases(*[100.0] * 2, *[0.0] * 8)),
        tune.Row("b", {"shift": 2}, cases(*[100.0] * 9, 0.0)),
        tune.Row("c", {"shift": 3}, cases(*[100.0] * 8, *[0.0] * 2)),
        tune.Row("d", {"shift": 4}, {}),
    ]
    assert tune.best(rows).label == "b"
    text = tune.markdown("t", rows, tune.best(rows), "string")
    assert "`b` **best** | 90.0 | [60, 98] | 10 |" in text and 'longreach.apply(model, "string", shift=2)' in text
    assert "intervals overlap): `c`." in text  # a is below b's interval; d has no cases
    with pytest.raises(ValueError, match="no setting has a finished case"):
        tune.best([tune.Row("x", {}, {})])


def test_paired_differences_use_only_the_cases_both_settings_ran():
    setting = tune.Row("s", {}, {(0.5, 0): 100.0, (0.5, 1): 50.0, (0.5, 2): 75.0, (0.5, 9): 0.0})
    rope = tune.Row("rope", {}, {(0.5, 0): 75.0, (0.5, 1): 25.0, (0.5, 2): 50.0, (0.5, 3): 100.0})
    assert setting.minus(rope) == (25.0, (25.0, 25.0), 3)  # seeds 9 and 3 have no partner
    value, (low, high), n = tune.Row("t", {}, cases(100.0, 0.0, 100.0, 0.0)).minus(
        tune.Row("r", {}, cases(0.0, 0.0, 0.0, 0.0))
    )
    assert (value, n) == (50.0, 4) and 0.0 <= low < 50.0 < high <= 100.0
    assert tune.Row("u", {}, {(0.5, 7): 1.0}).minus(rope)[2] == 0
    text = tune.markdown("t", [setting, rope], setting, "string", baseline=rope)
    assert (
        "| n | minus rope, same cases |" in text
        and "| `s` **best** | 56.2 | " in text
        and "| +25.0 [+25, +25] (n=3) |" in text
    )
    assert report.difference(float("nan"), (float("nan"),) * 2, 0) == "no common cases"
    zeros = [tune.Row(name, {}, cases(0.0, 0.0)) for name in ("a", "b", "rope")]  # every setting ties with rope
    text = tune.markdown("t", zeros, tune.best(zeros[:2]), "string", baseline=zeros[2])
    assert "No best: every setting scores 0.0 at this n, and rope too." in text and "Best:" not in text
    worse = [tune.Row("a", {}, cases(0.0, 100.0)), tune.Row("rope", {}, cases(100.0, 100.0))]
    assert "It is no better than rope (100.0) on these cases." in tune.markdown(
        "t", worse, worse[0], "string", baseline=worse[1]
    )


def test_tune_runs_the_grid_through_the_runner_and_resumes(tmp_path):
    loaded = text_model()
    args = ("tiny", "string", {"shift": [300, 500]}, "passkey", 700, 2, tmp_path, {"local_window": 8})
    table, winner, text = tune.run(*args, loaded=loaded)
    assert [row.label for row in table] == [
        "string:local_window=8,shift=300",
        "string:local_window=8,shift=500",
        "rope",
    ]
    assert all(row.n == 2 for row in table) and winner in table[:2]
    records = runner.read_results(tmp_path / runner.RESULTS)
    assert len(records) == 6 and {r["resolved"] for r in records} >= {
        "string(shift=500, local_window=8, mscale=False) [L=1024]"
    }
    saved = json.loads((tmp_path / "tune_string.json").read_text())
    assert saved["best"]["apply"] == tune.apply_line("string", winner.params) and len(saved["rows"]) == 3
    assert [row["minus_baseline"]["n"] for row in saved["rows"][:2]] == [2, 2] and "minus_baseline" not in saved[
        "rows"
    ][2]
    assert "| n | minus rope, same cases |" in text
    assert (tmp_path / "tune_string.png").stat().st_size > 0 and (tmp_path / "tune_string.md").read_text() == text
    tune.run(*args, loaded=loaded)  # a rerun finds every case done
    assert len((tmp_path / runner.RESULTS).read_text().splitlines()) == 6


@torch.no_grad()
def test_pair_importance_is_the_mean_product_of_pair_norms():
    """Layer 0 by hand: q and k projections of the normed embeddings, before RoPE (which keeps pair norms)."""
    model, _ = text_model()
    longreach.apply(model, "rope")
    x = torch.randint(3, 97, (1, 30))
    with pair_importance() as record:
        model(x)
    layer = model.model.layers[0]
    hidden = layer.input_layernorm(model.model.embed_tokens(x))
    q = layer.self_attn.q_proj(hidden).view(1, 30, 4, 16)
    k = layer.self_attn.k_proj(hidden).view(1, 30, 2, 16).repeat_interleave(2, dim=2)

    def norms(t):
        return torch.hypot(t[..., :8], t[..., 8:])

    want = (norms(q) * norms(k)).mean(1)  # [1, heads, pairs]
    assert sorted(record) == [0, 1] and torch.allclose(record[0], want, atol=1e-5)


@pytest.mark.slow
def test_calibrate_measures_importance_sweeps_each_group_and_checks_the_combination(tmp_path, monkeypatch):
    loaded = text_model()
    monkeypatch.chdir(tmp_path.parent)
    result = calibrate.calibrate(
        "tiny",
        2048,
        Path(tmp_path.name),
        samples=1,
        local_window=64,
        top_k=4,
        importance_samples=2,
        groups=4,
        training_window=512,
        loaded=loaded,
    )
    assert f"dimensions='{tmp_path / 'dimensions.safetensors'}'" in result["apply"]  # absolute: it works from anywhere
    monkeypatch.chdir("/")
    assert calibrate.importance_lengths(512) == [512] and calibrate.importance_lengths(8192) == [2048, 4096, 8192]
    assert result["sweep_values"] == [1, 2] and result["others_at"] == 8
    importance = load_file(str(tmp_path / "dimensions.safetensors"))["importance"]
    assert importance.shape == (2, 4, 8) and bool((importance > 0).all())
    assert sorted(p.name for p in (tmp_path / "importance").iterdir()) == ["512_0.safetensors", "512_1.safetensors"]
    assert all(len(rows) == 2 and all(r["n"] == 1 for r in rows) for rows in result["groups"].values())
    assert len(result["group_scales"]) == 4 and set(result["group_scales"]) <= {1, 2}
    assert [row["label"].split(":")[0] for row in result["check"]] == ["dpe", "rope"] and all(
        row["n"] == 1 for row in result["check"]
    )
    assert (
        result["minus_rope"]["n"] == 1
        and "the calibrated dpe minus rope: " in (tmp_path / "calibration.md").read_text()
    )
    assert result["apply"].startswith('longreach.apply(model, "dpe", group_scales=(') and "top_k=4" in result["apply"]
    for name in ("calibration.md", "calibration.json", "calibration.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert len(runner.read_results(tmp_path / runner.RESULTS)) == 4 * 2 + 2  # no swept setting has every group at 8
    model, _ = loaded
    exec(result["apply"], {"longreach": longreach, "model": model})  # the printed line works as it is
    assert longreach.describe(model).startswith("dpe(group_scales=")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["tune", "yarn", "--grid", "factor=2"], "tune takes a position method"),
        (["tune", "string", "--grid", "shift"], "must look like name=value1,value2"),
        (["tune", "string", "--grid", "shift=1", "--task", "nope"], "unknown task 'nope'"),
        (["tune", "string", "--grid", "shift=1", "--length", "4k,8k"], "gives 2 lengths: give one"),
        (["calibrate", "string"], "calibrate measures DPE's settings"),
        (
            ["calibrate", "dpe", "--length", "../../X"],
            "length '../../X' is out of range",
        ),  # echoed as given; no folder made
    ],
)
def test_command_errors_are_one_line(argv, message, capsys, tmp_path, monkeypatch):
    (tmp_path / "a" / "b").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "a" / "b")
    with pytest.raises(SystemExit) as exit:
        cli.main(argv)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == [Path("a"), Path("a/b")]  # nothing made
    assert message in str(exit.value) and "\n" not in str(exit.value)

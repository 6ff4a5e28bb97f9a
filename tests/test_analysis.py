"""Position frequency, position-matrix pictures and cost: exact numbers worked by hand."""

import numpy as np
import pytest
import transformers
from helpers.tiny_models import tiny_model

from longreach import cli, plots
from longreach.analysis import cost, frequency, matrix


def test_frequency_by_hand_for_each_packing():
    lengths = [3, 5, 10]  # L = 4: natural truncates to 3, 4, 4; 18 tokens in all
    assert frequency.frequency(lengths, 4, "natural").tolist() == [11, 8, 5, 2]  # sum max(|s| - i, 0)
    assert frequency.frequency(lengths, 4, "concatenated").tolist() == [18, 13, 8, 4]  # 4 windows of 4 + a rest of 2
    # uniform: 18 / 2.5 = 7.2 sequences with lengths evenly over 1..4: f(i) = 7.2/4 * sum_{l > i} (l - i)
    assert np.allclose(frequency.frequency(lengths, 4, "uniform"), [18, 10.8, 5.4, 1.8])


def test_shares_and_the_papers_skew():
    f = frequency.frequency([4], 4, "natural")  # 4, 3, 2, 1
    assert frequency.shares(f) == {"i < L/2": 0.7, "i >= 3L/4": 0.1}
    lengths = frequency.synthetic("lognormal:count=1000000")  # a million documents
    natural = frequency.shares(frequency.frequency(lengths, 2048))
    assert natural["i < L/2"] > 0.8 and natural["i >= 3L/4"] < 0.05  # the paper's SlimPajama shape
    concatenated = frequency.shares(frequency.frequency(lengths, 2048, "concatenated"))
    assert concatenated["i < L/2"] == pytest.approx(0.75, abs=1e-3)  # linear decline: 3/4 of the area


def test_frequency_errors_and_token_lengths(tmp_path):
    with pytest.raises(ValueError, match="packing='packed' is not one of"):
        frequency.frequency([3], 4, "packed")
    with pytest.raises(ValueError, match="window=0 is out of range"):
        frequency.frequency([3], 0)
    with pytest.raises(ValueError, match="synthetic distribution 'zipf' is not one of"):
        frequency.synthetic("zipf")
    (tmp_path / "a.txt").write_text("abc")
    (tmp_path / "b.txt").write_text("abcdefgh")
    from helpers.tiny_models import byte_tokenizer

    assert frequency.token_lengths(tmp_path, byte_tokenizer()).tolist() == [3, 8]


def test_matrix_reproduces_figure_5_and_refuses_frequency_methods(tmp_path):
    P, description = matrix.matrix("string", 9, shift=3, local_window=1)
    assert np.nan_to_num(P, nan=-1)[8].tolist() == [6, 5, 4, 3, 2, 1, 2, 1, 0]
    assert description.startswith("string(shift=3, local_window=1")
    assert matrix.plot(P, "fig 5", tmp_path / "m.png").stat().st_size > 0
    groups, description = matrix.matrix("dpe", 12, group_scales=(1, 2, 4), local_window=3, top_k=None)
    assert groups.shape == (12, 12, 3) and groups[11, 0].tolist() == [11, 11 // 2 + 3 - 1, 11 // 4 + 3 - 0]
    assert matrix.plot(groups, description, tmp_path / "dpe.png").stat().st_size > 0
    big, _ = matrix.matrix("dca", 300, training_window=200)
    assert matrix.plot(big, "dca", tmp_path / "big.png").stat().st_size > 0
    with pytest.raises(ValueError, match="'yarn' is a frequency method"):
        matrix.matrix("yarn", 9)


def llama_8b_shape():
    config = transformers.LlamaConfig(
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        hidden_size=4096,
        intermediate_size=14336,
        vocab_size=128256,
    )
    return cost.shape_of(config)


def test_kv_cache_of_a_llama_31_8b_shaped_config():
    shape = llama_8b_shape()
    assert cost.kv_cache_bytes(shape, 1) == 131_072  # 2 * 32 layers * 8 KV heads * 128 * 2 bytes
    assert cost.kv_cache_bytes(shape, 128 * 1024) == 16 * 2**30
    assert shape.parameters == 8_030_261_248  # Llama 3.1 8B, counted on the meta device


def test_attention_flops_by_hand():
    shape = cost.Shape(layers=2, heads=3, kv_heads=1, head_dim=4, parameters=0)
    assert cost.attention_pairs(4, "full") == 16 and cost.attention_pairs(4, "causal") == 10
    assert cost.attention_pairs(5, "sliding", 2) == 1 + 2 + 2 + 2 + 2  # min(i + 1, w) for i = 0..4
    assert cost.attention_pairs(3, "sliding", 10) == cost.attention_pairs(3, "causal")
    assert cost.attention_flops(shape, 4, "causal") == 4 * 4 * 3 * 2 * 10
    with pytest.raises(ValueError, match="window=None is out of range"):
        cost.attention_pairs(4, "sliding")


def test_parameter_count_on_meta_equals_the_real_model():
    model = tiny_model("qwen2")
    assert cost.count_parameters(model.config) == sum(p.numel() for p in model.parameters())


def test_cli_commands_write_their_pictures(tmp_path, capsys):
    config = tmp_path / "config.json"
    tiny_model("llama").config.to_json_file(config)
    cli.main(["cost", "--model", str(config), "--lengths", "1k,4k", "--out", str(tmp_path / "cost.png")])
    cli.main(["freq", "--synthetic", "exponential:count=1000", "--window", "256", "--out", str(tmp_path / "freq.png")])
    cli.main(
        ["matrix", "self_extend:group_size=2,neighbor_window=2", "--length", "8", "--out", str(tmp_path / "m.png")]
    )
    cli.main(["methods"])
    out = capsys.readouterr().out
    assert "| 1K |" in out and " GiB | " in out and "| natural |" in out and "| `dca` | position |" in out
    assert all((tmp_path / name).stat().st_size > 0 for name in ("cost.png", "freq.png", "m.png"))
    with pytest.raises(SystemExit, match="give exactly one of"):
        cli.main(["freq", "--out", str(tmp_path / "x.png")])


def test_line_plot_legend_wraps_long_methods_and_stays_off_the_lines(tmp_path, monkeypatch):
    dpe = (
        "dpe:dimensions=docs/study/dpe_dimensions_8k.safetensors,group_scales=2;2;2;2;2;2;2;2,"
        "local_window=1024,top_k=24"
    )
    wrapped = plots.legend_label(dpe)  # the method, not the path its file was read from
    assert max(len(line) for line in wrapped.splitlines()) <= 56 and wrapped.count("\n") >= 2
    assert wrapped.replace("\n", " ").replace(", ", ",") == dpe.replace(
        "docs/study/dpe_dimensions_8k.safetensors", "dpe_dimensions_8k"
    )
    assert plots.legend_label("rope") == "rope"
    figures = []
    monkeypatch.setattr(plots.plt, "close", figures.append)  # keep the figure to measure it
    path = plots.lines(
        {"rope": ([4096, 8192], [33.2, 25.6]), dpe: ([4096, 8192], [37.1, 34.3])},
        "RULER",
        tmp_path / "lines.png",
        threshold=85.6,
        bands={"rope": [(28, 38), (21, 31)]},
        marks={"training window": 8192},
    )
    ax = figures[0].axes[0]
    renderer = figures[0].canvas.get_renderer()
    assert ax.get_legend().get_window_extent(renderer).x0 > ax.get_window_extent(renderer).x1
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "rope",
        wrapped,
        "threshold 85.6",
        "training window (8K)",
    ]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["4K", "8K"] and not ax.texts and path.stat().st_size > 0
    path = plots.panels(
        {
            0: {"rope": ([1, 2], [0.5, 0.4]), dpe: ([1, 2], [0.6, 0.5])},
            1: {"rope": ([1, 2], [0.3, 0.2]), dpe: ([1, 2], [0.4, 0.3])},
        },
        "dispersion",
        tmp_path / "panels.png",
        xlabel="query position",
    )
    legend = figures[1].legends[0]  # the dispersion panels' shared legend: beside the last panel, wrapped
    renderer = figures[1].canvas.get_renderer()
    assert legend.get_window_extent(renderer).x0 >= max(a.get_window_extent(renderer).x1 for a in figures[1].axes)
    assert [t.get_text() for t in legend.get_texts()] == ["rope", wrapped] and path.stat().st_size > 0
    path = plots.heatmap(
        np.array([[10.0, np.nan], [56.0, 95.0]]),
        ["0-50%", "50-100%"],
        ["12K", "16K"],
        f"niah4 — {dpe}",
        tmp_path / "heat.png",
        value="needles found (%)",
    )
    title = figures[2].axes[0].title  # a calibrated DPE's title wrapped, inside the figure
    renderer = figures[2].canvas.get_renderer()
    box, page = title.get_window_extent(renderer), figures[2].bbox
    assert title.get_text().count("\n") >= 2 and page.x0 <= box.x0 and box.x1 <= page.x1 and path.stat().st_size > 0
    assert figures[2].axes[1].get_ylabel() == "needles found (%)"  # the colour bar says what a cell is
    inks = {t.get_text(): t.get_color() for t in figures[2].axes[0].texts}
    assert inks == {"10": "white", "56": "black", "95": "white"}  # white on dark red and dark green, black on yellow


def test_the_comparison_draws_the_paired_difference_under_the_scores(tmp_path, monkeypatch):
    figures = []
    monkeypatch.setattr(plots.plt, "close", figures.append)
    plots.compare(
        {"rope": ([2048, 4096], [50.0, 20.0]), "string": ([2048, 4096], [50.0, 45.0])},
        {"rope": [(40, 60), (12, 30)], "string": [(40, 60), (35, 55)]},
        "passkey",
        tmp_path / "c.png",
        "pass rate (%)",
        {"string": ([2048, 4096], [0.0, 25.0], [(0.0, 0.0), (10.0, 40.0)])},
        "rope",
        threshold=85.6,
        marks={"training window": 4096},
    )
    scores, differences = figures[0].axes
    assert scores.get_ylim() == (-3, 103) and scores.get_ylabel() == "pass rate (%)"
    assert "minus rope" in differences.get_ylabel() and [t.get_text() for t in differences.get_xticklabels()] == [
        "2K",
        "4K",
    ]
    assert any(list(line.get_ydata()) == [0, 0] for line in differences.get_lines())  # the line at 0
    (caps,) = [c for c in differences.containers]
    assert [list(segment[:, 1]) for segment in caps.lines[2][0].get_segments()] == [[0.0, 0.0], [10.0, 40.0]]

"""Haystacks, tasks, scoring, the resumable runner and reports (tiny models and a byte tokenizer)."""

import json
import types

import pytest
import torch
from helpers.tiny_models import TINY_VOCAB, byte_tokenizer, text_model, tiny_model

from longreach import provenance
from longreach.eval import haystack, report, runner, tasks
from longreach.eval.engines.transformers import Transformers
from longreach.eval.grid import Grid, depth_grid, parse_lengths
from longreach.eval.report import cells as report_cells
from longreach.eval.report import pictures
from longreach.eval.report import run_sections as report_runs
from longreach.eval.string_match import needles_found, string_match_all, string_match_part
from longreach.methods.spec import MethodSpec


@pytest.fixture(scope="module")
def tokenizer():
    return byte_tokenizer()


def test_scoring_rules_on_hand_made_answers():
    assert string_match_all("The numbers are 123 and 456.", ["123", "456", "789"]) == pytest.approx(200 / 3)
    assert string_match_all("ABC", ["abc"]) == 100.0
    assert string_match_part("Paris, France", ["London", "paris"]) == 100.0
    assert string_match_part("Rome", ["London", "Paris"]) == 0.0
    answer = "1. 1111111 2. 2222222 3. 9999999"
    assert needles_found(answer, ["1111111", "2222222", "3333333", "4444444"]) == [
        True,
        True,
        False,
        False,
    ]


def test_fit_largest_packs_the_budget_and_names_what_does_not_fit(tokenizer):
    def build(n):
        return "Q: " + "ab " * n + "?"

    n, prompt, tokens = haystack.fit_largest(tokenizer, 500, build, start=10)
    assert tokens == len(prompt) <= 500 < len(build(n + 1)) and prompt == build(n)
    with pytest.raises(ValueError, match="the prompt with 1 of its lines already takes 7 tokens, over the budget of 5"):
        haystack.fit_largest(tokenizer, 5, build, start=10, what="x", unit="lines")
    with pytest.raises(ValueError, match="all 40 documents take only 124 of the 500 tokens"):
        haystack.fit_largest(tokenizer, 500, build, start=10, most=40, unit="documents")


def test_bos_is_written_once_and_base_models_get_the_bare_text(tokenizer):
    assert haystack.with_bos(tokenizer, "text") == "text"  # the byte tokenizer adds no BOS by default
    llama_like = byte_tokenizer()
    llama_like._tokenizer.post_processor = __import__("tokenizers").processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 1)]
    )
    assert haystack.with_bos(llama_like, "text") == "<s>text" and haystack.with_bos(llama_like, "<s>text") == "<s>text"
    bare = byte_tokenizer()
    bare.chat_template = None
    assert haystack.templated(bare, "Task.", " Answer:") == "Task. Answer:"  # RULER's base template


@pytest.mark.parametrize(  # InfiniteBench's published records: tests/test_infbench.py
    "name",
    [n for n in tasks.TASKS if not n.startswith("ruler") and getattr(tasks.get(n), "synthetic", True)]
    + ["ruler-tight:niah_single_1", "ppl"],
)
def test_every_task_is_deterministic_and_has_its_answers_in_the_prompt(tokenizer, name):
    task = tasks.get(name)
    case = task.build(tokenizer, 1200, 0.25, seed=1)
    again = task.build(tokenizer, 1200, 0.25, seed=1)
    other = task.build(tokenizer, 1200, 0.25, seed=2)
    assert case.prompt == again.prompt and case.references == again.references
    assert case.prompt != other.prompt
    assert 0.9 * 1200 <= case.n_tokens + case.max_new_tokens <= 1200
    for reference in case.references:
        assert reference in case.prompt.split("<|im_start|>assistant")[0]
    if name != "ppl":
        assert task.score(" ".join(case.references), case)["score"] == 100.0
        assert task.score("nothing", case)["score"] == 0.0


def test_ruler_expands_to_its_tasks_and_unknown_names_fail():
    names = tasks.expand("ruler")
    assert {"ruler:niah_single_1", "ruler:vt", "ruler:cwe", "ruler:fwe", "ruler:niah_multiquery"} <= set(names)
    assert [name.replace("ruler:", "ruler-tight:") for name in names] == tasks.expand("ruler-tight")
    with pytest.raises(ValueError, match="unknown task 'needle'"):
        tasks.expand("needle")


def test_lengths_methods_and_depths_parse_with_clear_errors():
    assert parse_lengths("2k, 4k,8192") == [2048, 4096, 8192]
    assert depth_grid(5) == [0.0, 0.25, 0.5, 0.75, 1.0] and depth_grid(1) == [0.5]
    spec = MethodSpec.parse("string:shift=2048,local_window=64,mscale=true")
    assert spec.name == "string" and dict(spec.params) == {"shift": 2048, "local_window": 64, "mscale": True}
    assert spec.label == "string:local_window=64,mscale=True,shift=2048"
    assert dict(MethodSpec.parse("drop:rate=0.3,layers=0;1;2").params) == {"rate": 0.3, "layers": (0, 1, 2)}
    for bad in ("2q", "2.5", "8"):
        with pytest.raises(ValueError, match=f"length '{bad}' is out of range: a whole number of tokens from 16"):
            parse_lengths(bad)
    with pytest.raises(ValueError, match="must look like name=value"):
        MethodSpec.parse("string:shift")
    with pytest.raises(ValueError, match="--depths=0 is out of range"):
        depth_grid(0)


def test_effective_length_rule():
    assert report_cells.effective_length({2048: 100, 4096: 90, 8192: 50}) == 4096
    assert report_cells.effective_length({2048: 80, 4096: 90}) == 0  # the first length already fails
    assert report_cells.effective_length({2048: 90, 4096: 80, 8192: 95}) == 2048  # every shorter length must pass


def tiny_grid(tmp_path):
    loaded = text_model()
    grid = Grid(
        "tiny",
        ["niah", "niah4", "passkey", "ppl", "ruler-tight:niah_single_1"],
        [MethodSpec.parse("rope"), MethodSpec.parse("string:shift=300,local_window=8")],
        [700, 1000],
        [0.0, 1.0],
        2,
    )
    return grid, loaded


def test_time_per_case_keeps_batch_sizes_apart():
    """Cases decoded 8 at a time and one at a time get a row each: one median over both describes neither."""
    case = {"model": "m", "machine": "cpu", "dtype": "float32", "task": "passkey", "method": "rope", "length": 16384}
    records = [{**case, "batch": 8, "seconds": 220.0}] * 8 + [
        {**case, "batch": 1, "seconds": s} for s in (100.0, 110.0, 120.0)
    ]
    markdown = report_runs.time_section(records)
    assert "| cpu, float32 | passkey | rope | 1 | 3 | 110.0 |" in markdown
    assert "| cpu, float32 | passkey | rope | 8 | 8 | 220.0 |" in markdown
    assert markdown.index("| rope | 1 |") < markdown.index("| rope | 8 |")
    assert report_runs.seconds_by_batch(records) == {"1": 110.0, "8": 220.0}  # summary.json's cells split them alike
    other = [{**case, "model": "other", "batch": 1, "seconds": 50.0}]  # two models in one folder: a row each
    markdown = report_runs.time_section(records[8:] + other)
    assert (
        "| m | cpu, float32 | passkey | rope | 1 | 3 | 110.0 |" in markdown
        and "| other | cpu, float32 | passkey | rope | 1 | 1 | 50.0 |" in markdown
    )


def test_file_names_of_long_method_labels_stay_short_and_apart():
    dpe = (
        "dpe:dimensions=docs/study/dpe_dimensions_16k.safetensors,group_scales=4;4;4;4;4;4;4;4,"
        "local_window=1024,top_k=24"
    )
    names = {
        pictures.slug(dpe),
        pictures.slug(dpe.replace("top_k=24", "top_k=32")),
        pictures.slug(dpe + ",layers=" + ";".join(map(str, range(80)))),
    }
    assert len(names) == 3 and all(len(name) <= 60 and name.startswith("dpe_dimensions_docs_study") for name in names)
    assert pictures.slug("string:shift=300,local_window=8") == "string_shift_300_local_window_8"  # short ones unchanged


@pytest.mark.slow
def test_the_pipeline_end_to_end_on_a_tiny_model(tmp_path):
    grid, loaded = tiny_grid(tmp_path)
    path = runner.run(grid, tmp_path, Transformers(loaded))
    records = runner.read_results(path)
    assert len(records) == len(grid) == 5 * 2 * 2 * 2
    assert {(r["model"], r["method"], r["task"], r["length"], r["depth"], r["seed"]) for r in records} == set(
        grid.keys()
    )
    assert {r["depth"] for r in records if r["task"] == "niah"} == {0.0, 1.0}  # the grid task cycles through the depths
    assert all(r["n_tokens"] + r["max_new_tokens"] <= r["length"] for r in records if r["task"] != "ppl")
    assert {r["resolved"] for r in records} == {
        "rope [L=1024]",
        "string(shift=300, local_window=8, mscale=False) [L=1024]",
    }
    assert all(
        r["prompt_hash"] and r["seconds"] >= 0 and r["machine"] == "cpu" and r["batch"] >= 1 and r["dtype"] == "float32"
        for r in records
    )
    (run,) = provenance.read(tmp_path)  # who ran it: recorded before the first case
    assert (
        run["longreach"] == provenance.version()
        and run["model"] == run["model_name"] == "tiny"
        and run["cases"] == len(grid)
    )
    assert run["command"].startswith("longreach ") and run["torch"] == torch.__version__
    markdown = report.build(tmp_path)
    for name in [
        "summary.md",
        "summary.json",
        "summary.csv",
        "compare_niah4.png",
        "compare_ppl.png",
        "heatmap_niah_rope.png",
        "heatmap_niah4_string_local_window_8_shift_300.png",
    ]:
        assert (tmp_path / name).stat().st_size > 0, name
    assert "## niah4" in markdown and "effective length" in markdown and "Fraction of the needles" in markdown
    assert (
        "## RULER" in markdown
        and "incomplete" in markdown
        and "## Time per case" in markdown
        and "| cpu, float32 | niah4 | rope | 1 |" in markdown
    )
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert {(c["task"], c["method"], c["length"]) for c in summary["cells"]} == {
        (k[2], k[1], k[3])
        for k in grid.keys()  # noqa: SIM118 (the grid's case keys; a Grid is not a dict)
    }
    assert all(c["n"] == 2 and c["low"] <= c["score"] <= c["high"] for c in summary["cells"] if c["task"] != "ppl")
    assert all(set(c["seconds_per_case"]) == {"1"} for c in summary["cells"])
    assert {(p["task"], p["length"], p["n"]) for p in summary["paired"]} == {
        (t, n, 2) for t in grid.tasks if t != "ppl" for n in (700, 1000)
    }
    assert "Minus rope on the same cases" in markdown
    # the report is a function of the JSONL alone
    (tmp_path / "summary.md").unlink()
    assert report.build(tmp_path) == markdown
    kept = [line for line in (tmp_path / runner.RESULTS).read_text().splitlines() if '"method": "rope"' in line]
    (tmp_path / runner.RESULTS).write_text("\n".join(kept) + "\n")  # string's results gone: so are its pictures
    (tmp_path / "calibration.png").write_bytes(b"not the report's")
    report.build(tmp_path)
    assert not list(tmp_path.glob("heatmap_*string*.png")) and (tmp_path / "heatmap_niah_rope.png").exists()
    assert (tmp_path / "calibration.png").exists()


@pytest.mark.slow
def test_records_and_summary_say_what_a_length_meant(tmp_path):
    """Each case records its haystack size and, for ruler:*, the size RULER's search found for its task and length;
    summary.json and summary.md give per task and length the prompt tokens (mean, min, max) and that size."""
    loaded = text_model()
    grid = Grid("tiny", ["ruler:niah_single_1", "passkey"], [MethodSpec.parse("rope")], [1000], [0.5], 3)
    records = runner.read_results(runner.run(grid, tmp_path, Transformers(loaded)))
    ruler_cases = [r for r in records if r["task"] == "ruler:niah_single_1"]
    (searched,) = {r["searched_units"] for r in ruler_cases}
    assert all(r["haystack_units"] <= searched and (searched - r["haystack_units"]) % 5 == 0 for r in ruler_cases)
    assert all("searched_units" not in r and r["haystack_units"] > 0 for r in records if r["task"] == "passkey")
    markdown = report.build(tmp_path)
    rows = {row["task"]: row for row in json.loads((tmp_path / "summary.json").read_text())["sizes"]}
    tokens = [r["n_tokens"] for r in ruler_cases]
    assert rows["ruler:niah_single_1"] == {
        "model": "tiny",
        "task": "ruler:niah_single_1",
        "length": 1000,
        "cases": 3,
        "tokens": {"mean": sum(tokens) / 3, "min": min(tokens), "max": max(tokens)},
        "haystack_units": {
            "min": min(r["haystack_units"] for r in ruler_cases),
            "max": max(r["haystack_units"] for r in ruler_cases),
        },
        "searched_units": [searched],
    }
    assert rows["passkey"]["searched_units"] is None and rows["passkey"]["cases"] == 3
    assert "## Prompt sizes" in markdown and f"; searched {searched} |" in markdown


def test_paired_differences_against_rope_pair_the_same_cases(tmp_path):
    """string minus rope per length, over the (depth, seed)s both ran; a case only one method ran is left out."""
    base = {"model": "m", "task": "passkey", "metric": "exact", "window": 1024, "seconds": 1.0}
    scores = {
        ("rope", 0): 0.0,
        ("rope", 1): 100.0,
        ("rope", 2): 0.0,
        ("string", 0): 100.0,
        ("string", 1): 100.0,
        ("string", 2): 100.0,
        ("string", 3): 0.0,
    }
    lines = [
        json.dumps(
            {**base, "method": method, "resolved": method, "length": 700, "depth": 0.5, "seed": seed, "score": score}
        )
        for (method, seed), score in scores.items()
    ]
    (tmp_path / runner.RESULTS).write_text("\n".join(lines) + "\n")
    markdown = report.build(tmp_path)
    paired = json.loads((tmp_path / "summary.json").read_text())["paired"]
    assert len(paired) == 1 and paired[0]["method"] == "string" and paired[0]["minus"] == "rope" and paired[0]["n"] == 3
    assert (
        paired[0]["difference"] == pytest.approx(200 / 3)
        and 0 <= paired[0]["low"] < paired[0]["difference"] <= paired[0]["high"] == 100
    )
    assert "| string | +66.7 [+0, +100] (n=3) |" in markdown


def write_records(folder, scores: dict, **fields):
    """A results file of hand-made records: ``scores`` maps (method, task, length, seed) to a score."""
    base = {"model": "m", "metric": "exact", "window": 1024, "seconds": 1.0, "depth": None, **fields}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / runner.RESULTS).write_text(
        "".join(
            json.dumps({**base, "method": m, "resolved": m, "task": t, "length": n, "seed": s, "score": v}) + "\n"
            for (m, t, n, s), v in scores.items()
        )
    )


def test_the_study_picks_the_best_complete_methods_and_publishes_every_folder(tmp_path):
    from longreach import study

    mean_of = {"rope": 0, "string": 100, "a": 50, "b": 75, "c": 25, "partial": 100}
    scores = {
        (m, t, n, s): float(100 * (s < v / 25))
        for m, v in mean_of.items()
        for t in ("passkey", "niah4")
        for n in (700, 1000)
        for s in range(4)
        if m != "partial" or n == 700
    }
    write_records(tmp_path / "study_window", scores)
    assert study.best(tmp_path / "study_window", ["rope", "string"], 2) == ["b", "a"]  # "partial" lacks its 1000 cells
    with pytest.raises(ValueError, match="run step 1"):
        study.best(tmp_path / "study_window", ["rope", "string", "a", "b"], 2)
    (tmp_path / "study_window" / "heatmap_of_an_earlier_report.png").write_bytes(b"stale")
    index = study.publish([tmp_path / "study_window", tmp_path / "study_beyond"], tmp_path / "docs")
    published = {p.name for p in (tmp_path / "docs" / "window").iterdir()}
    assert (
        "heatmap_of_an_earlier_report.png" not in published
        and {"compare_niah4.png", "compare_passkey.png"} <= published
    )
    assert (tmp_path / "docs" / "window" / runner.RESULTS).read_text() == (
        tmp_path / "study_window" / runner.RESULTS
    ).read_text()
    assert (tmp_path / "docs" / "window" / "summary.md").exists() and (
        tmp_path / "docs" / "window" / "compare_niah4.png"
    ).exists()
    text = index.read_text()
    assert "study_beyond" not in text and "| passkey | partial | 4 | — |" in text
    assert "| niah4 | string | +100.0 [+100, +100] (n=4) | +100.0 [+100, +100] (n=4) |" in text
    with pytest.raises(ValueError, match="holds results yet"):
        study.publish([tmp_path / "study_beyond"], tmp_path / "docs")


def greedy_raising_on_call(monkeypatch, call: int, error: BaseException):
    """Make the runner's greedy decoding raise ``error`` on its ``call``-th use; returns the real function."""
    from longreach.eval import generate

    real, calls = generate.greedy, {"n": 0}

    def raising(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == call:
            raise error
        return real(*args, **kwargs)

    monkeypatch.setattr(generate, "greedy", raising)
    return real


@pytest.mark.slow
def test_a_crash_mid_run_loses_nothing_and_a_rerun_duplicates_nothing(tmp_path, monkeypatch, capsys):
    grid, loaded = tiny_grid(tmp_path)
    greedy_raising_on_call(monkeypatch, 5, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        runner.run(grid, tmp_path, Transformers(loaded))
    saved = runner.read_results(tmp_path / runner.RESULTS)
    assert len(saved) == 4
    with (tmp_path / runner.RESULTS).open("a") as sink:  # a line cut short by the crash
        sink.write(json.dumps(saved[0])[:40])
    runner.run(grid, tmp_path, Transformers(loaded), limit=3)
    assert len(runner.read_results(tmp_path / runner.RESULTS)) == 7
    runner.run(grid, tmp_path, Transformers(loaded))
    records = runner.read_results(tmp_path / runner.RESULTS)
    keys = [runner.case_key(r) for r in records]
    assert len(keys) == len(set(keys)) == len(grid)
    capsys.readouterr()
    report.build(tmp_path)  # the ended cut-off line is not a warning on every later read
    assert "warning" not in capsys.readouterr().err


def test_the_dtype_reaches_the_loader_and_a_folder_keeps_one_precision(tmp_path, monkeypatch):
    from longreach import models

    grid, (model, tokenizer) = tiny_grid(tmp_path)
    grid = Grid("tiny", ["passkey"], grid.methods[:1], [700], [0.5], 2, dtype="bfloat16")
    asked = []
    monkeypatch.setattr(models, "load", lambda name, dtype, **_: asked.append(dtype) or (model.to(dtype), tokenizer))
    monkeypatch.setattr(models, "load_config", lambda name: model.config)
    runner.run(grid, tmp_path)
    assert asked == [torch.bfloat16]
    assert {r["dtype"] for r in runner.read_results(tmp_path / runner.RESULTS)} == {"bfloat16"}
    with pytest.raises(ValueError, match="--dtype=fp32 is not one of: auto, float32"):
        Grid("tiny", ["passkey"], grid.methods, [700], [0.5], 2, dtype="fp32")
    with pytest.raises(ValueError, match=r"--dtype resolves to float32, but .* holds results in bfloat16"):
        runner.run(grid, tmp_path, Transformers((model.to(torch.float32), tokenizer)))


def test_method_specs_expand_the_paper_protocol_and_compose():
    assert MethodSpec.parse("dca:protocol=paper").arguments(8192) == ("dca", {"chunk_size": 4095, "local_window": 682})
    assert MethodSpec.parse("yarn:protocol=paper").arguments(8192) == (
        "yarn",
        {"factor": 1.5, "original_max_position_embeddings": 5461},
    )
    assert MethodSpec.parse("string+yarn:factor=2,shift=100").arguments(300) == (
        "string",
        {"scaling": {"rope_type": "yarn", "factor": 2}, "shift": 100},
    )
    with pytest.raises(ValueError, match="protocol='llama' is not one of: paper"):
        MethodSpec.parse("dca:protocol=llama").arguments(8192)
    with pytest.raises(ValueError, match="after '\\+': unknown frequency method 'dca'; frequency methods: pi, ntk"):
        MethodSpec.parse("string+dca").arguments(8192)


def test_any_mix_of_methods_runs_through_the_runner(tmp_path):
    loaded = text_model()
    specs = [
        "rope",
        "string:shift=300,local_window=8",
        "dca:protocol=paper",
        "self_extend",
        "rerope:leak=2",
        "yarn:factor=2",
        "string+ntk:factor=2,shift=300,local_window=8",
        "dynamic_drop:chunk=100,layers=0;1",
    ]
    grid = Grid("tiny", ["passkey"], [MethodSpec.parse(m) for m in specs], [700], [0.5], 1)
    records = runner.read_results(runner.run(grid, tmp_path, Transformers(loaded)))
    assert [r["method"] for r in records] == [MethodSpec.parse(m).label for m in specs]
    assert records[2]["resolved"] == "dca(chunk_size=511, local_window=85, mscale=False) [L=1024]"
    assert records[-2]["resolved"].startswith("string(shift=300, local_window=8, mscale=False) + ntk(factor=2)")
    assert (
        records[-1]["resolved"].startswith("rope + dynamic_drop(initial_rate=0.15")
        and "layers=[0, 1]" in records[-1]["resolved"]
    )


@pytest.mark.slow
def test_a_failing_case_becomes_an_error_row_and_the_grid_goes_on(tmp_path, monkeypatch):
    grid, loaded = tiny_grid(tmp_path)
    real = greedy_raising_on_call(monkeypatch, 2, ValueError("a bug in one case"))
    runner.run(grid, tmp_path, Transformers(loaded))
    records = runner.read_results(tmp_path / runner.RESULTS)
    failed = [r for r in records if r.get("error")]
    assert len(records) == len(grid) and len(failed) == 1 and failed[0]["error"] == "ValueError: a bug in one case"
    markdown = report.build(tmp_path)
    assert "## Failed cases" in markdown and "ValueError: a bug in one case" in markdown
    from longreach.eval import generate

    monkeypatch.setattr(generate, "greedy", real)
    runner.run(
        grid, tmp_path, Transformers(loaded)
    )  # a rerun retries the failed case only; its success replaces the error row
    records = runner.read_results(tmp_path / runner.RESULTS)
    assert len(records) == len(grid) and not any(r.get("error") for r in records)
    assert "## Failed cases" not in report.build(tmp_path)


def test_a_case_whose_scoring_raises_keeps_its_answer_and_the_others_their_scores(tmp_path, monkeypatch):
    """Issue trust4, defect 1: one batch of four, the second case's scorer raising. That case is recorded answered,
    with the scoring error named; the cases after it in the batch are scored, each with its own outcome."""
    model = tiny_model("llama", vocab_size=TINY_VOCAB, max_position_embeddings=1024)
    grid = Grid("tiny", ["passkey"], [MethodSpec.parse("rope")], [700], [0.5], 4)
    task = tasks.get("passkey")
    real = type(task).score

    def score(self, answer, case):
        if case.seed == 1:
            raise AttributeError("'int' object has no attribute 'lower'")
        return real(self, answer, case)

    monkeypatch.setattr(type(task), "score", score)
    for _ in range(2):  # the rerun tries the unscored case again, and only it
        runner.run(grid, tmp_path, Transformers((model, byte_tokenizer())), batch_size=4)
        records = {r["seed"]: r for r in runner.read_results(tmp_path / runner.RESULTS)}
        assert sorted(records) == [0, 1, 2, 3] and all(r["batch"] == 4 for r in records.values())
        bad = records.pop(1)
        assert bad["error"] == "scoring the answer failed: AttributeError: 'int' object has no attribute 'lower'"
        assert bad["score"] is None and isinstance(bad["answer"], str)
        assert all(r.get("error") is None and r["score"] in (0.0, 100.0) for r in records.values())
    assert len((tmp_path / runner.RESULTS).read_text().splitlines()) == 5


def test_eval_sets_up_before_the_first_case_is_timed(tmp_path, monkeypatch, capsys):
    """Issue trust4, item 14: the kernel's first build was in the first batch's time. The engine sets up once, when its
    first method is applied, outside any case's time, and says so on a line of its own."""
    from longreach.attention.backends import cpu_fused
    from longreach.eval import generate, outcomes

    events, greedy, clock = [], generate.greedy, outcomes.time.perf_counter
    monkeypatch.setattr(cpu_fused, "ensure_built", lambda: events.append("set-up") or True)
    monkeypatch.setattr(generate, "greedy", lambda *a, **k: events.append("answer") or greedy(*a, **k))
    monkeypatch.setattr(outcomes, "time", types.SimpleNamespace(perf_counter=lambda: events.append("clock") or clock()))
    grid = Grid("tiny", ["passkey"], [MethodSpec.parse("rope"), MethodSpec.parse("string")], [700], [0.5], 2)
    runner.run(grid, tmp_path, Transformers(text_model()), batch_size=2)
    # the cases built (two readings of the clock), the set-up, then the clock that times the batch, its answers
    assert events[:5] == ["clock", "clock", "set-up", "clock", "answer"] and events.count("set-up") == 1
    assert capsys.readouterr().err.count("set-up: the attention kernel and a first forward pass") == 1

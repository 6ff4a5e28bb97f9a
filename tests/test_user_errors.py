"""Bad input gets one line naming the parameter, its value and what is allowed; never a traceback.

Each case here was a traceback, a silent wrong answer or a message that did not name the parameter.
"""

import json
import math
import re

import numpy as np
import pytest
import torch
from helpers.tiny_models import TINY_VOCAB, byte_tokenizer, tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import longreach
from longreach import cli, models
from longreach.eval import report, runner
from longreach.eval.engines.transformers import Transformers
from longreach.eval.grid import Grid
from longreach.methods.spec import MethodSpec


@pytest.fixture(autouse=True)
def in_a_temporary_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # default output folders (runs/...) land there, not in the checkout


def cli_error(argv, capsys) -> str:
    """Run the CLI; it must exit non-zero with one readable line (ours or argparse's), and no traceback."""
    with pytest.raises(SystemExit) as stop:
        cli.main(argv)
    err = capsys.readouterr().err
    if isinstance(stop.value.code, str):  # ours: sys.exit("longreach: error: ...")
        message = stop.value.code
        assert message.startswith("longreach: error: ") and "\n" not in message
        return message
    assert stop.value.code == 2 and "Traceback" not in err  # argparse: usage line + one error line
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["eval", "niah", "--lengths", "inf"], "length 'inf' is out of range"),
        (["eval", "niah", "--lengths", "1e400"], "length '1e400' is out of range"),
        (["eval", "niah", "--lengths", "nan"], "length 'nan' is out of range"),
        (["eval", "niah", "--limit", "-1"], "argument --limit: -1 is out of range"),
        (["eval", "niah", "--samples", "0"], "argument --samples/--seeds: 0 is out of range"),
        (["eval", "niah", "--batch-size", "0"], "argument --batch-size: 0 is out of range"),
        (
            ["eval", "niah", "--prefill-tokens", "-1"],
            "argument --prefill-tokens: '-1' is out of range: an integer >= 0 or 'auto'",
        ),
        (
            ["eval", "niah", "--prefill-tokens", "half"],
            "argument --prefill-tokens: 'half' is out of range: an integer >= 0 or 'auto'",
        ),
        (["eval", "niah", "--method", "string:shift=2048,shift=1024"], "'shift' is given twice"),
        (["eval", "niah", "--method", ":shift=3"], "names no method"),
        (["eval", "niah", "--training-window", "x"], "argument --training-window: 'x' is not an integer"),
        (["dispersion", "--length", "2k,4k"], "--length=2k,4k gives 2 lengths: give one"),
        (["dispersion", "--text", "/no/such/file.txt"], "--text=/no/such/file.txt does not exist"),
        (["freq", "--lengths-file", "/no/such/lengths.txt"], "--lengths-file=/no/such/lengths.txt does not exist"),
        (["matrix", "string", "--length", "100000"], "--length=100000 is out of range"),
        (["report", "/no/such/folder"], "/no/such/folder is not a results folder"),
        (["eval", "niah", "--samples", "100000000", "--limit", "1"], "--samples=100000000 is out of range: 1 .. 10000"),
        (["eval", "niah", "--threshold", "nan"], "argument --threshold: nan is out of range: a score from 0 to 100"),
        (["report", ".", "--threshold", "150"], "argument --threshold: 150 is out of range: a score from 0 to 100"),
        (["cost", "--model", "/etc/passwd"], "--model=/etc/passwd is not a model config: not JSON"),
        (["freq", "--synthetic", "lognormal:count=-1"], "count=-1 is out of range: a whole number of documents"),
        (["freq", "--synthetic", "lognormal:sigma=nan"], "sigma=nan is out of range"),
        (["freq", "--synthetic", "exponential:scale"], "exponential parameter 'scale' must look like name=number"),
        (["serve-demo", "--port", "99999"], "argument --port: 99999 is out of range: a port is 1 .. 65535"),
    ],
)
def test_cli_errors_are_one_clear_line(argv, expected, capsys):
    assert expected in cli_error(argv, capsys)


def test_cli_out_paths_that_cannot_be_written(tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    assert "--out=" + str(a_file) + " is a file, not a folder" in cli_error(
        ["eval", "niah", "--out", str(a_file)], capsys
    )
    assert "is not a writable folder" in cli_error(["eval", "niah", "--out", "/proc/longreach"], capsys)
    assert "is not a writable folder" in cli_error(["demo", "--out", str(a_file / "below")], capsys)
    assert "is a folder: give a file name" in cli_error(
        ["matrix", "string:shift=3,local_window=1", "--out", str(tmp_path)], capsys
    )
    assert "is not a writable folder" in cli_error(
        ["matrix", "string:shift=3,local_window=1", "--out", "/proc/x/m.png"], capsys
    )
    cli.main(["matrix", "string:shift=3,local_window=1", "--out", str(tmp_path / "picture")])  # matplotlib adds .png
    assert f"wrote {tmp_path / 'picture.png'}" in capsys.readouterr().out and (tmp_path / "picture.png").is_file()


def test_a_model_folder_without_a_model_says_so(tmp_path, capsys):
    (tmp_path / "tokenizer.json").write_text("{}")
    message = cli_error(["eval", "niah", "--model", str(tmp_path), "--out", str(tmp_path / "out")], capsys)
    assert "holds no config.json (not a saved model)" in message
    (tmp_path / "config.json").write_text(tiny_model("llama").config.to_json_string())
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle")
    message = cli_error(["eval", "niah", "--model", str(tmp_path), "--out", str(tmp_path / "out")], capsys)
    assert "has no safetensors weights (pytorch_model.bin); longreach refuses .bin on purpose" in message


def test_a_saved_model_without_its_tokenizer_names_the_call_that_saves_it(tmp_path, capsys, monkeypatch):
    """``model.save_pretrained("out"); longreach.load("out")`` (the API guide's two lines) ended in transformers'
    six-line error about converting a slow tokenizer: the tokenizer was never saved. Now one line, before any weights
    load, naming ``tokenizer.save_pretrained``; with the tokenizer saved too, the model comes back applied."""
    model = tiny_model("llama")
    longreach.apply(model, "string", shift=40, local_window=8)
    model.save_pretrained(tmp_path / "out")
    folder = str(tmp_path / "out")
    with monkeypatch.context() as patched:
        patched.setattr(
            "transformers.AutoModelForCausalLM.from_pretrained", lambda *a, **k: pytest.fail("weights loaded")
        )
        with pytest.raises(RuntimeError) as error:
            longreach.load(folder)
        message = cli_error(["eval", "niah", "--model", folder, "--out", str(tmp_path / "runs")], capsys)
    assert str(error.value) == (
        f"cannot load model {folder!r}: the folder {folder} has no tokenizer (no tokenizer.json or "
        f"tokenizer_config.json); save it beside the model: tokenizer.save_pretrained({folder!r})"
    )
    assert f"tokenizer.save_pretrained({folder!r})" in message
    byte_tokenizer().save_pretrained(folder)
    loaded, tokenizer = longreach.load(folder)
    assert longreach.describe(loaded) == longreach.describe(model) and tokenizer is not None


@pytest.mark.parametrize(
    "record, expected",
    [
        ("string", "the 'longreach' record is str 'string'; allowed: a dict with method, training_window"),
        (["string"], "the 'longreach' record is list ['string']; allowed: a dict"),
        (
            {"method": "string", "params": {}},
            "the 'longreach' record has no 'training_window'; allowed: an integer >= 2 (tokens)",
        ),
        ({"training_window": 96}, "the 'longreach' record has no 'method'; allowed: a method name"),
        (
            {"method": "string", "training_window": 96, "params": [1]},
            "the 'longreach' record's 'params' is [1]; allowed: a dict",
        ),
        (
            {"method": "string", "training_window": "96"},
            "the 'longreach' record's 'training_window' is '96'; allowed: an integer >= 2",
        ),
        (
            {"method": "string", "training_window": 96, "scaling": "yarn"},
            "the 'longreach' record's 'scaling' is 'yarn'; allowed: null or a dict",
        ),
        ({}, "the 'longreach' record has no 'method'"),
    ],
)
def test_a_malformed_record_in_a_saved_config_is_one_line_before_loading(
    record, expected, tmp_path, capsys, monkeypatch
):
    """``load`` and ``eval`` on a saved model whose config.json holds a damaged ``longreach`` record: one line naming
    the file and the field, before any weights load (they were AttributeError, KeyError and TypeError tracebacks)."""
    model = tiny_model("llama")
    model.save_pretrained(tmp_path / "saved")
    byte_tokenizer().save_pretrained(tmp_path / "saved")
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    (tmp_path / "saved" / "config.json").write_text(json.dumps({**config, "longreach": record}))
    monkeypatch.setattr(
        "transformers.AutoModelForCausalLM.from_pretrained", lambda *a, **k: pytest.fail("weights loaded")
    )
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'saved' / 'config.json'}: {expected}")):
        longreach.load(str(tmp_path / "saved"))
    message = cli_error(
        ["eval", "niah", "--model", str(tmp_path / "saved"), "--out", str(tmp_path / "out"), "--limit", "1"], capsys
    )
    assert expected in message and "config.json" in message


def test_every_method_is_checked_on_the_config_before_the_weights_load(tmp_path, capsys, monkeypatch):
    """``eval --method strng`` loaded the model first and failed 12-23 s later (minutes for an 8B model), listing the
    position methods only: each --method is now applied to an empty (meta) model of the config first."""
    tiny_model("llama").save_pretrained(tmp_path / "saved")
    byte_tokenizer().save_pretrained(tmp_path / "saved")
    monkeypatch.setattr(
        "transformers.AutoModelForCausalLM.from_pretrained", lambda *a, **k: pytest.fail("weights loaded")
    )
    for method, expected in [
        (
            "strng",
            "unknown method 'strng'; did you mean string? methods: rope, string, rerope, self_extend, dca, "
            "dpe, pi, ntk, dynamic, yarn, llama3, drop, dynamic_drop",
        ),
        ("string+yrn:factor=2", "after '+': unknown frequency method 'yrn'; did you mean yarn?"),
        ("string:shift=500", "shift=500 is out of range: local_window < shift < L = 96"),
        ("yarn:factor=0.5", "factor=0.5 is out of range"),
        ("dynamic_drop:layers=5", "layers=[5] is out of range: layer indices 0 .. 1"),
    ]:
        message = cli_error(
            [
                "eval",
                "niah",
                "--model",
                str(tmp_path / "saved"),
                "--method",
                "rope",
                "--method",
                method,
                "--out",
                str(tmp_path / "out"),
                "--lengths",
                "64",
            ],
            capsys,
        )
        assert expected in message, message


@pytest.mark.parametrize(
    "method, params, expected",
    [
        ("yarn", {"factor": math.nan}, "factor=nan is out of range"),
        ("pi", {"factor": math.inf}, "factor=inf is out of range"),
        ("rerope", {"leak": math.nan}, "leak=nan is out of range"),
        ("dynamic_drop", {"step": math.nan}, "step=nan is out of range"),
        ("yarn", {"attention_factor": -1}, "attention_factor=-1 is out of range"),
        ("yarn", {"original_max_position_embeddings": 0}, "original_max_position_embeddings=0 is out of range"),
        ("yarn", {"beta_fast": "x"}, "beta_fast must be a number"),
        ("llama3", {"low_freq_factor": 0}, "low_freq_factor=0 is out of range"),
        ("llama3", {"low_freq_factor": 4.0, "high_freq_factor": 4.0}, "high_freq_factor=4.0 is out of range"),
        ("string", {"shift": "20"}, "shift must be an integer"),
        ("rope", {"scaling": "yarn"}, "scaling='yarn' must be a dict"),
        ("rope", {"scaling": {"factor": 2}}, "names no rope_type"),
        ("rope", {"drop": 0.3}, "drop=0.3 must be a dict"),
        ("drop", {"foo": 1}, "drop has no parameter foo; its parameters: rate, layers"),
        ("rope", {"drop": {"method": "dynamic_drop", "foo": 1}}, "dynamic_drop has no parameter foo"),
        ("dpe", {"group_scales": (), "top_k": None}, "group_scales=() is out of range"),
        ("ntk", {"factor": 1e308}, "factor=1e+308 is out of range"),
        ("string", {"training_window": 10**30}, "training_window=10" + "0" * 29 + " is out of range"),
        ("self_extend", {"neighbor_window": 10**30}, "neighbor_window > 0, at most 2147483647"),
        ("self_extend", {"group_size": 10**30}, "group_size >= 1, at most 2147483647"),
        ("dca", {"chunk_size": 10**30}, "chunk_size > local_window > 0, at most 2147483647"),
        ("dpe", {"local_window": 2**63, "group_scales": (1, 2), "top_k": None}, "local_window > 0, at most 2147483647"),
        ("dpe", {"local_window": 10**30, "group_scales": (1, 2), "top_k": None}, "local_window > 0, at most"),
        ("self_extend", {"neighbor_window": 2**63}, "neighbor_window=9223372036854775808 is out of range"),
    ],
)
def test_api_errors_name_the_parameter(method, params, expected):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=re.escape(expected)):
        longreach.apply(model, method, **params)
    assert longreach.applied(model) is None


def test_numpy_numbers_are_numbers():
    model = tiny_model("llama")
    longreach.apply(model, "yarn", factor=np.float32(2.0), original_max_position_embeddings=np.int64(64))
    assert model.config.rope_parameters["factor"] == 2.0
    longreach.apply(model, "drop", rate=np.float64(0.2), layers=np.array([0, 1]).tolist())
    assert "drop(rate=0.2, layers=[0, 1])" in longreach.describe(model)


def small_grid(tmp_path, methods=("rope",), model="tiny", window=None):
    grid = Grid(model, ["passkey"], [MethodSpec.parse(m) for m in methods], [300], [0.5], 1, window)
    return grid, (tiny_model("llama", vocab_size=TINY_VOCAB, max_position_embeddings=1024), byte_tokenizer())


def test_lines_that_are_not_records_are_skipped_with_a_warning(tmp_path, capsys):
    """Every field is checked: a bad line costs itself and one warning naming its line, never the file or a resume."""
    grid, loaded = small_grid(tmp_path)
    runner.run(grid, tmp_path, Transformers(loaded))
    path = tmp_path / runner.RESULTS
    (good,) = runner.read_results(path)
    bad = [
        "123",
        "{}",
        "[1, 2]",
        *(
            json.dumps({**good, **change})
            for change in (
                {"score": "abc"},
                {"resolved": []},
                {"resolved": ["rope"]},
                {"length": 1e30},
                {"model": [1]},
                {"seed": -1},
                {"depth": 2},
                {"score": None},
                {"found": "x"},
                {"metric": None},
                {"score": float("nan")},
            )
        ),
    ]
    missing_metric = {k: v for k, v in good.items() if k != "metric"}
    with path.open("ab") as sink:
        sink.write(("\n".join([*bad, json.dumps(missing_metric)]) + "\n").encode())
        sink.write(b'{"model": "\xff\xfe broken"}\n')  # not UTF-8: one line lost, not the file
    capsys.readouterr()
    assert runner.read_results(path) == [good]
    warnings = capsys.readouterr().err.splitlines()
    assert len(warnings) == len(bad) + 2 and all(f"results.jsonl:{n}" in w for n, w in enumerate(warnings, 2))
    assert 'resolved=["rope"] is not a method as resolved' in warnings[5] and "missing metric" in warnings[-2]
    runner.run(grid, tmp_path, Transformers(loaded))  # eval resumes past them
    assert len(runner.read_results(path)) == 1 and "| rope |" in report.build(tmp_path)


def test_cases_are_keyed_on_the_models_folder_and_weights_not_the_name_given(tmp_path):
    """'tiny' and 'tiny/' are one model; the same folder with other weights is another (the review)."""
    model, tokenizer = tiny_model("llama", vocab_size=TINY_VOCAB, max_position_embeddings=1024), byte_tokenizer()
    model.save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")

    def run(name):
        return runner.run(
            Grid(name, ["passkey"], [MethodSpec.parse("rope")], [300], [0.5], 1),
            tmp_path / "out",
            Transformers((model, tokenizer)),
        )

    run(str(tmp_path / "tiny"))
    run(str(tmp_path / "tiny") + "/")  # the same folder: done already
    assert len(runner.read_results(tmp_path / "out" / runner.RESULTS)) == 1
    assert models.identity(str(tmp_path / "tiny")) == models.identity(str(tmp_path / "tiny") + "/")
    retrained = tiny_model("llama", vocab_size=TINY_VOCAB, max_position_embeddings=1024)
    with torch.no_grad():
        retrained.lm_head.weight.mul_(2)
    retrained.save_pretrained(tmp_path / "tiny")  # the same config, other weights
    run(str(tmp_path / "tiny"))
    records = runner.read_results(tmp_path / "out" / runner.RESULTS)
    assert len(records) == 2 and len({r["model_key"] for r in records}) == 2
    assert report.build(tmp_path / "out").count("## passkey — ") == 2  # one name, two models: told apart by digest


def test_two_models_and_two_windows_in_one_folder_are_reported_apart(tmp_path):
    for model, window in (("tiny-a", None), ("tiny-b", None), ("tiny-a", 512)):
        grid, loaded = small_grid(tmp_path, ("rope", "rope"), model, window)  # the same method twice: once
        runner.run(grid, tmp_path, Transformers(loaded))
    records = runner.read_results(tmp_path / runner.RESULTS)
    assert len(records) == 3 and {r["window"] for r in records} == {1024, 512}
    markdown = report.build(tmp_path)
    assert "## passkey — tiny-a" in markdown and "## passkey — tiny-b" in markdown
    assert "| rope = rope [L=1024] |" in markdown and "| rope = rope [L=512] |" in markdown
    with (tmp_path / runner.RESULTS).open("a") as sink:  # a concurrent run wrote the same case again
        sink.write(json.dumps(records[0]) + "\n")
    assert len(runner.read_results(tmp_path / runner.RESULTS)) == 3
    grid, loaded = small_grid(tmp_path, ("string:shift=100,local_window=8",), "tiny-a", 512)
    runner.run(grid, tmp_path, Transformers(loaded))
    assert "Minus rope on the same cases" in report.build(tmp_path)  # paired with the rope of its own L
    (paired,) = json.loads((tmp_path / "summary.json").read_text())["paired"]
    assert paired["minus"] == "rope = rope [L=512]" and paired["n"] == 1


def test_lengths_far_beyond_the_window_are_refused(tmp_path):
    grid, loaded = small_grid(tmp_path)
    grid.lengths = [33 * 1024]
    with pytest.raises(ValueError, match="--lengths 33792 is out of range: at most 32 x L = 32768 tokens"):
        runner.run(grid, tmp_path, Transformers(loaded))


SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
commands = ["eval", "demo", "dispersion", "freq", "matrix", "cost", "report"]
flags = [
    "--lengths",
    "--length",
    "--limit",
    "--seeds",
    "--samples",
    "--batch-size",
    "--depths",
    "--method",
    "--out",
    "--training-window",
    "--window",
    "--points",
    "--top-k",
    "--threshold",
    "--lengths-file",
    "--text",
    "--synthetic",
    "--dtype",
]
junk = st.sampled_from(
    [
        "-1",
        "0",
        "nan",
        "inf",
        "1e400",
        "2k,4k",
        "x",
        "",
        "string:shift=",
        "dca:chunk_size=1,local_window=5",
        "yarn:factor=nan",
        "/proc/x",
        "/no/such",
        "llama3:low_freq_factor=0",
        "string:shift=2,shift=3",
        ",,,",
    ]
)


@pytest.mark.slow
@SETTINGS
@given(
    command=st.sampled_from(commands), pairs=st.lists(st.tuples(st.sampled_from(flags), junk), min_size=1, max_size=3)
)
def test_random_malformed_command_lines_end_in_a_clear_error(command, pairs, capsys, monkeypatch, tmp_path):
    """Arguments are checked before a model loads; a model that would load is replaced by a failing stub.
    Any exception other than ``SystemExit`` (a traceback for a person) fails the test."""
    from longreach import models

    def no_model(*_, **__):
        raise RuntimeError("no model in this test")

    monkeypatch.setattr(models, "load", no_model)
    monkeypatch.setattr(models, "load_config", no_model)
    monkeypatch.chdir(tmp_path)
    argv = [command] + {"eval": ["niah"], "matrix": ["string"], "report": ["/no/such"]}.get(command, [])
    for flag, value in pairs:
        argv += [flag, value]
    try:
        cli.main(argv)
    except SystemExit as stop:
        if isinstance(stop.code, str):
            assert stop.code.startswith("longreach: error: ") and "\n" not in stop.code
        else:
            assert stop.code == 2 and "Traceback" not in capsys.readouterr().err
    # else: a combination that happened to be valid (e.g. freq with a synthetic source) ran to the end


def test_processes_probing_one_out_folder_at_once_do_not_trip_each_other(tmp_path):
    """Under torchrun every rank checks --out at the same moment: a shared probe file name let one rank delete
    the other's probe between its write and its unlink ("No such file or directory")."""
    from concurrent.futures import ThreadPoolExecutor

    from longreach.cli.arguments import writable_folder

    with ThreadPoolExecutor(8) as pool:
        folders = list(pool.map(lambda _: writable_folder(str(tmp_path / "out")), range(2000)))
    assert set(folders) == {tmp_path / "out"}
    assert list((tmp_path / "out").iterdir()) == []

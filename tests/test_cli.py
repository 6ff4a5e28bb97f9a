"""The command line: fast to answer, documented flag by flag, tidy on failure, and what it prints and records."""

import json
import subprocess
import sys

import pytest

from longreach import cli, provenance
from longreach.eval import runner


def test_the_command_line_loads_without_torch_and_says_its_version():
    """--help must answer in well under a second: building the parser imports no torch, transformers or matplotlib;
    ``import longreach`` neither, and its public names still resolve (imported on first use)."""
    code = (
        "import sys, longreach, longreach.cli; longreach.cli.build_parser(); "
        "print(sorted(m for m in ('torch', 'transformers', 'matplotlib') if m in sys.modules))"
    )
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "[]"
    )
    version = subprocess.run(
        [sys.executable, "-m", "longreach", "--version"], capture_output=True, text=True, check=True
    ).stdout
    assert version.startswith(f"longreach {provenance.version()}") and version.count("\n") == 1
    assert ("(git " in version) == (provenance.commit() is not None)  # a clone says its commit
    import longreach

    assert longreach.apply.__module__ == "longreach.integrations.transformers" and callable(longreach.methods.create)


def test_every_flag_and_argument_has_help():
    def parsers(parser):
        yield parser
        for action in parser._actions:
            for child in getattr(action, "choices", None) or {}:
                if hasattr(action.choices, "values"):
                    yield from parsers(action.choices[child])

    missing = [
        f"{p.prog} {a.option_strings or a.dest}"
        for p in parsers(cli.build_parser())
        for a in p._actions
        if a.help in (None, "") and a.dest != "command" and a.dest != "action"
    ]
    assert not missing, missing


def test_a_run_that_fails_before_its_first_case_leaves_no_folder(tmp_path):
    (tmp_path / "not_a_model").mkdir()
    with pytest.raises(SystemExit, match="holds no config.json"):
        cli.main(
            ["eval", "niah", "--model", str(tmp_path / "not_a_model"), "--out", str(tmp_path / "runs" / "new" / "eval")]
        )
    assert not (tmp_path / "runs").exists()
    (tmp_path / "kept").mkdir()  # a folder that was there before stays, even empty
    with pytest.raises(SystemExit, match="holds no config.json"):
        cli.main(["eval", "niah", "--model", str(tmp_path / "not_a_model"), "--out", str(tmp_path / "kept" / "eval")])
    assert (
        set(tmp_path.iterdir()) == {tmp_path / "not_a_model", tmp_path / "kept"}
        and list((tmp_path / "kept").iterdir()) == []
    )


def test_report_prints_plain_tables_and_writes_who_ran_it_and_a_ruler_style_csv(tmp_path, capsys):
    base = {
        "model": "default",
        "metric": "first_integer",
        "window": 1024,
        "seconds": 1.0,
        "depth": None,
        "task": "passkey",
    }
    scores = {("rope", 2048, 0): 100.0, ("rope", 2048, 1): 0.0, ("string", 2048, 0): 100.0, ("string", 2048, 1): 100.0}
    (tmp_path / runner.RESULTS).write_text(
        "".join(
            json.dumps(
                {
                    **base,
                    "method": m,
                    "resolved": m,
                    "length": n,
                    "seed": s,
                    "score": v,
                    "empty": s == 1 and m == "rope",
                }
            )
            + "\n"
            for (m, n, s), v in scores.items()
        )
    )
    run = {
        "started": "2025-01-01T00:00:00+0000",
        "longreach": "0.1.0",
        "git": {"commit": "0bf9c232678d" + "0" * 28, "uncommitted_changes": False},
        "command": "longreach eval passkey --lengths 2k",
        "model": "default",
        "model_name": provenance.model_name("default", None),
        "cases": 4,
        "processes": 1,
    }
    (tmp_path / provenance.RUNS).write_text(json.dumps(run) + "\n")
    cli.main(["report", str(tmp_path)])
    out = capsys.readouterr().out
    assert "![" not in out and "|" not in out and "passkey: pass rate (% of cases whose first number is the key)" in out
    assert any(
        line.split()
        == ["string", "100.0", "[34,", "100]", "n=2", "2K", "(sure:", "none);", "relative", "2K", "(sure:", "none)"]
        for line in out.splitlines()
    )
    assert any(line.split()[:3] == ["string", "+50.0", "[+0,"] for line in out.splitlines())  # the paired difference
    with (tmp_path / "summary.csv").open() as rows:
        assert rows.read().splitlines() == [
            "model,task,length,method,metric,score,low,high,n,nulls,effective_length,sure_effective_length,"
            "relative_effective_length,sure_relative_effective_length",
            "default,passkey,2048,rope,first_integer,50.00,9.45,90.55,2,1/2,0,0,2048,0",
            "default,passkey,2048,string,first_integer,100.00,34.24,100.00,2,0/2,2048,0,2048,0",
        ]
    markdown = (tmp_path / "summary.md").read_text()
    assert "Model: default = HuggingFaceTB/SmolLM2-135M-Instruct (SmolLM2-135M-Instruct.Q4_1.gguf" in markdown
    assert "| 2025-01-01T00:00:00+0000 | 0.1.0 (git 0bf9c232678d) | HuggingFaceTB/SmolLM2" in markdown
    assert "| 4 | `longreach eval passkey --lengths 2k` |" in markdown
    assert json.loads((tmp_path / "summary.json").read_text())["runs"] == [run]

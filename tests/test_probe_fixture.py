"""The probing experiment's final natural-data model (window 256, ``make probing``), shipped as a fixture: on it,
`rope` retrieves poorly at the undertrained end of the window and STRING repairs that (docs/probing.md)."""

import json
from dataclasses import asdict

import pytest

from longreach import demo
from longreach.eval import on_model
from longreach.eval.stats import RULER_THRESHOLD
from longreach.integrations.transformers import remove
from longreach.methods.spec import MethodSpec
from longreach.probe import corpus, experiment, measure, task, train

FIXTURE = (
    demo.MODEL
)  # a run folder holding the experiment's final window-256 natural checkpoint, shipped in the package
WINDOW = 256
STRING = f"string:local_window={experiment.LOCAL_WINDOW}"  # the experiment's STRING at its default S = L/3
CASES = 50  # per distance; the last third of the experiment's 16 distances holds 5: n = 250


@pytest.fixture(scope="module")
def last_third():
    """``(distances, rope's table, STRING's table)`` on the fixture's last third of distances, the same cases."""
    model, _ = train.load(train.checkpoints(FIXTURE)[-1])
    band = [d for d in measure.distances(WINDOW) if d >= 2 * WINDOW / 3]
    rope = measure.by_distance(model, WINDOW, band, CASES)
    on_model.apply(model, MethodSpec.parse(STRING), WINDOW)
    string = measure.by_distance(model, WINDOW, band, CASES)
    remove(model)
    return band, rope, string


def test_the_fixture_is_the_experiments_final_natural_model():
    state = train.state_of(train.checkpoints(FIXTURE)[-1])
    assert state["step"] == experiment.STEPS and state["corpus"]["distribution"] == "natural"
    assert state["corpus"]["window"] == WINDOW and state["corpus"]["median"] * WINDOW == experiment.MEDIAN_TOKENS
    assert state["shape"] == asdict(train.Shape())  # the default model


@pytest.mark.slow
def test_rope_retrieves_poorly_at_the_undertrained_distances(last_third):
    band, rope, _ = last_third
    assert (
        min(rope[d]["high"] for d in band) < RULER_THRESHOLD
    )  # somewhere in the last third, below RULER's bar for sure


@pytest.mark.slow
def test_string_raises_retrieval_on_the_last_third_by_a_margin_its_interval_supports(last_third):
    band, rope, string = last_third
    difference, (low, _), n = measure.paired_difference(string, rope, band)
    assert n >= 100 and low > 0, (difference, low, n)


@pytest.mark.slow
def test_the_fixture_feeds_longreach_eval_and_tune_as_a_model_without_a_tokenizer(tmp_path):
    """``longreach eval`` and ``tune`` take a probe checkpoint with the ``probe`` tasks (token ids, no tokenizer);
    a text task on it is refused in one line."""
    from longreach import cli

    checkpoint = str(train.checkpoints(FIXTURE)[-1])
    cli.main(
        [
            "eval",
            "probe-tail",
            "--model",
            checkpoint,
            "--method",
            "rope",
            "--method",
            STRING,
            "--lengths",
            "256",
            "--samples",
            "6",
            "--out",
            str(tmp_path / "eval"),
        ]
    )
    records = [json.loads(line) for line in (tmp_path / "eval" / "results.jsonl").read_text().splitlines()]
    assert len(records) == 12 and all(r["score"] in (0.0, 100.0) and not r.get("error") for r in records)
    assert all(0 <= int(r["answer"]) < corpus.VOCAB for r in records)
    tail = task.TASKS["probe-tail"].distances(WINDOW)
    assert sorted({round((1 - r["needle_depths"][0]) * WINDOW) for r in records}) == tail  # seeds cycle over the tail
    cli.main(
        [
            "tune",
            "string",
            "--grid",
            "shift=64,128",
            "--set",
            "local_window=8",
            "--task",
            "probe-tail",
            "--length",
            "256",
            "--samples",
            "6",
            "--model",
            checkpoint,
            "--out",
            str(tmp_path / "tune"),
        ]
    )
    tuned = json.loads((tmp_path / "tune" / "tune_string.json").read_text())
    assert [row["label"] for row in tuned["rows"]] == [
        "string:local_window=8,shift=64",
        "string:local_window=8,shift=128",
        "rope",
    ]
    assert tuned["best"]["apply"].startswith('longreach.apply(model, "string"') and all(
        row["n"] == 6 for row in tuned["rows"]
    )
    with pytest.raises(SystemExit, match="has no tokenizer .*passkey needs one; its tasks are probe and probe-tail"):
        cli.main(
            [
                "eval",
                "passkey",
                "--model",
                checkpoint,
                "--lengths",
                "256",
                "--samples",
                "1",
                "--out",
                str(tmp_path / "text"),
            ]
        )

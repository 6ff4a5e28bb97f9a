"""The probing experiment's final natural-data model (window 256, ``make probing``), shipped as a fixture: on it,
`rope` retrieves poorly at the undertrained end of the window and STRING repairs that (docs/probing.md)."""

from dataclasses import asdict
from pathlib import Path

import pytest

from longreach.eval.runner import MethodSpec
from longreach.eval.stats import RULER_THRESHOLD
from longreach.integrations.transformers import remove
from longreach.probe import cli, experiment, measure, train

FIXTURE = Path(__file__).parent / "fixtures" / "probe_natural_256"  # a run folder holding its final checkpoint
WINDOW = 256
STRING = f"string:local_window={experiment.LOCAL_WINDOW}"  # the experiment's STRING at its default S = L/3
CASES = 50  # per distance; the last third of the experiment's 16 distances holds 5: n = 250


@pytest.fixture(scope="module")
def last_third():
    """``(distances, rope's table, STRING's table)`` on the fixture's last third of distances, the same cases."""
    model, _ = train.load(train.checkpoints(FIXTURE)[-1])
    band = [d for d in measure.distances(WINDOW) if d >= 2 * WINDOW / 3]
    rope = measure.by_distance(model, WINDOW, band, CASES)
    MethodSpec.parse(STRING).apply(model, WINDOW)
    string = measure.by_distance(model, WINDOW, band, CASES)
    remove(model)
    return band, rope, string


def test_the_fixture_is_the_experiments_final_natural_model():
    state = train.state_of(train.checkpoints(FIXTURE)[-1])
    assert state["step"] == cli.EXPERIMENT_STEPS and state["corpus"]["distribution"] == "natural"
    assert state["corpus"]["window"] == WINDOW and state["corpus"]["median"] * WINDOW == experiment.MEDIAN_TOKENS
    assert state["shape"] == asdict(train.Shape())  # the default model


def test_rope_retrieves_poorly_at_the_undertrained_distances(last_third):
    band, rope, _ = last_third
    assert min(rope[d]["high"] for d in band) < RULER_THRESHOLD  # somewhere in the last third, below RULER's bar for sure


def test_string_raises_retrieval_on_the_last_third_by_a_margin_its_interval_supports(last_third):
    band, rope, string = last_third
    difference, (low, _), n = measure.paired_difference(string, rope, band)
    assert n >= 100 and low > 0, (difference, low, n)

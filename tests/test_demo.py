"""``make demo``: RoPE and STRING by distance on the shipped probe model, resumable, with a table a person can read
(the effect itself, at the demo's n, is tests/test_probe_fixture.py's)."""

import json

import pytest

from longreach import demo
from longreach.probe import measure

pytestmark = pytest.mark.slow  # the shipped model over every distance, twice: about 20 s


def test_the_demo_measures_both_methods_at_every_distance_and_resumes(tmp_path, monkeypatch):
    text = demo.main(tmp_path, cases=4)
    saved = json.loads((tmp_path / demo.RESULTS).read_text())
    grid = measure.distances(256)
    assert saved["cases"] == 4 and all(sorted(map(int, saved["tables"][m])) == grid for m in demo.METHODS)
    assert (tmp_path / "demo.png").stat().st_size > 10_000 and (tmp_path / "demo.txt").read_text().strip() == text
    assert (
        "RoPE and STRING (S = 85, W = 16)" in text
        and "string minus rope over the last third (d >= 172), the same 24 cases" in text
    )
    assert text.count("<- beyond S") == sum(d >= 85 for d in grid) and "How to read it." in text
    del saved["tables"]["string"]["250"]  # as if stopped before the last distance
    (tmp_path / demo.RESULTS).write_text(json.dumps(saved))
    measured, real = [], measure.by_distance
    monkeypatch.setattr(
        measure,
        "by_distance",
        lambda model, window, distances, cases: measured.append(distances) or real(model, window, distances, cases),
    )
    assert demo.main(tmp_path, cases=4) == text  # the same cases: the same table
    assert measured == [[250]]

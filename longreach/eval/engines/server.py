"""``longreach eval --server URL``: the cases sent to an OpenAI-compatible completions endpoint, as RULER's
``client_wrappers`` send them (a ``vllm serve`` with longreach's plugin, or any server longreach does not control).

Each prompt goes as the token ids the model's own tokenizer makes of it (the OpenAI API takes a prompt as a list of
ids), so a length means what it means in RULER and on the other engines; greedy (``temperature`` 0), the task's
``max_new_tokens``. Up to ``concurrency`` requests are in flight. A connection error or a 5xx answer is retried with
exponential backoff; a case that still fails is recorded as failed with its reason (a rerun tries it again). Each
case is written as soon as it is answered, so Ctrl-C keeps every finished one. A server that does not answer at all
stops the run with one line before any case, and the folder resumes.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed

from ..task_protocol import EVALUATE
from .base import Engine, EngineGone

RETRIES = 4  # tries after the first, waiting BACKOFF x 1, 2, 4, 8
BACKOFF = 1.0  # seconds
TIMEOUT = 600.0  # seconds for one answer: a 128K prompt on a busy server
MODEL_LIST = 'a model list {"data": [{"id": "<model>"}, ...]}'  # what GET /v1/models answers (OpenAI's API)


class Unreachable(RuntimeError):
    """The server did not answer: refused, timed out, or gone."""


class Server(Engine):
    """The OpenAI-compatible server at ``url`` (``http://host:port``, with or without ``/v1``), asked at once for its
    model; ``tokenizer`` builds the prompts; ``concurrency`` requests in flight at most. Its method is its own: each
    ``--method`` label (``--label``) stands for it."""

    name = "server"

    def __init__(self, url: str, tokenizer, concurrency: int = 8, timeout: float = TIMEOUT):
        self.base = url.rstrip("/").removesuffix("/v1")
        self.tokenizer, self.concurrency, self.timeout = tokenizer, concurrency, timeout
        self.dtype = "as served"
        self.machine = f"server {self.base}"
        try:
            models = _request(f"{self.base}/v1/models", None, timeout=10.0)
        except Unreachable as error:
            raise RuntimeError(f"--server {url}: {error}; is the server running at that address?") from None
        except urllib.error.HTTPError as error:
            answer = f"GET /v1/models answered {error.code}"
            raise RuntimeError(f"--server {url}: {answer}: not an OpenAI-compatible server?") from None
        except ValueError:
            raise RuntimeError(f"--server {url}: GET /v1/models answered no JSON, not {MODEL_LIST}") from None
        self.model = served_model(models, url)
        try:
            version = _request(f"{self.base}/version", None, timeout=10.0).get("version", "unknown")
        except (Unreachable, urllib.error.HTTPError, ValueError):
            version = "unknown"
        self.record = {"engine": self.name, "engine_version": str(version), "served_model": self.model}

    def start(self, grid, world) -> dict[str, str]:
        """The config of ``grid.model`` (its ``L``, the run's provenance); each label stands for the server's method."""
        from ... import models
        from ...integrations.transformers import training_window

        self.config = models.load_config(grid.model)
        self.window = grid.training_window or training_window(self.config)
        return {spec.label: spec.label for spec in grid.methods}

    def decode(self, task, label: str, cases: list) -> Iterator[tuple[int, dict]]:
        """Every case of the batch requested concurrently, each yielded as its answer (or its failure) comes."""
        if task.kind == EVALUATE:
            raise ValueError(f"task {task.name} scores the model's logits: run it with --engine transformers")
        unanswered = 0
        with ThreadPoolExecutor(self.concurrency) as pool:
            futures = {pool.submit(self._answer, case, task.max_new_tokens): i for i, case in enumerate(cases)}
            try:
                for future in as_completed(futures):
                    fields, gone = future.result()
                    unanswered += gone
                    yield futures[future], fields
            except BaseException:  # Ctrl-C, or the consumer gone: no new request starts
                for future in futures:
                    future.cancel()
                raise
        if cases and unanswered == len(cases):
            raise EngineGone(
                f"the server at {self.base} stopped answering (no answer to any of {len(cases)} requests after "
                f"{RETRIES + 1} tries each); every finished case is saved: run the same command again to go on"
            )

    def _answer(self, case, max_new_tokens: int) -> tuple[dict, bool]:
        """``({"answer": text}, False)``, or ``({"error": reason}, whether the server never answered)`` after the
        retries."""
        ids = self.tokenizer(case.prompt, add_special_tokens=False).input_ids
        body = {"model": self.model, "prompt": ids, "max_tokens": max_new_tokens, "temperature": 0.0, "seed": 0}
        for attempt in range(RETRIES + 1):
            try:
                reply = _request(f"{self.base}/v1/completions", body, self.timeout)
                return {"answer": reply["choices"][0]["text"].strip()}, False
            except urllib.error.HTTPError as error:
                reason, unanswered = f"HTTP {error.code}: {_message(error)}", False
                if error.code < 500:  # the request itself is wrong: trying it again changes nothing
                    return {"error": reason}, False
            except Unreachable as error:
                reason, unanswered = str(error), True
            except (KeyError, IndexError, ValueError) as error:
                return {"error": f"an answer without choices[0].text ({error.__class__.__name__})"}, False
            if attempt < RETRIES:
                time.sleep(BACKOFF * 2**attempt)
        return {"error": f"{reason} (after {RETRIES + 1} tries)"}, unanswered

    def ready(self, label: str) -> None:
        """Nothing to start: the server runs."""

    def close(self) -> None:
        """Nothing to stop: the server is not ours."""


def served_model(models, url: str) -> str:
    """The first model of ``GET /v1/models``'s answer, or a one-line ``RuntimeError`` that shows what came instead."""
    data = models.get("data") if isinstance(models, dict) else None
    first = data[0] if isinstance(data, list) and data else None
    if not (isinstance(first, dict) and isinstance(first.get("id"), str) and first["id"]):
        shown = json.dumps(models)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        raise RuntimeError(
            f"--server {url}: GET /v1/models answered {shown}, not {MODEL_LIST}: is it an OpenAI-compatible server "
            "with a model loaded?"
        )
    return first["id"]


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


def _message(error: urllib.error.HTTPError) -> str:
    """An error answer's message (OpenAI's ``{"error": {"message": ...}}``, or a top-level ``message``)."""
    try:
        body = json.loads(error.read())
        nested = body.get("error")
        return (nested.get("message") if isinstance(nested, dict) else None) or body.get("message") or str(error.reason)
    except (ValueError, AttributeError):
        return str(error.reason)

"""The results file: one JSON record per case, checked field by field whenever it is read.

A results folder is read by every resume and every report, and people edit, merge and copy these
files by hand. A line that is not a record -- not JSON, not UTF-8, a field of the wrong type or out
of range, a required field missing -- is skipped with one warning naming its line and what is wrong
with it; every other line still counts. A truncated last line (a crash while writing) is skipped
silently; the next run ends it with :data:`CUT_OFF` before appending, and it stays silent.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import sys
from pathlib import Path
from typing import NamedTuple

RESULTS = "results.jsonl"
MAX_LENGTH = 1 << 24  # 16M tokens: beyond any model; grid.check_lengths bounds lengths by the model's L
DTYPES = (
    "auto",
    "float32",
    "bfloat16",
    "float16",
)  # what --dtype takes; auto: the checkpoint's own (a record keeps what it resolved to)
REQUIRED = ("model", "method", "task", "length", "depth", "seed", "score")
CUT_OFF = "  <- cut off by a crash; the case was run again"  # ends such a line (append only: nothing is rewritten)


def _text(value) -> bool:
    return isinstance(value, str)


def _integer(low: int, high: int | None = None):
    return lambda value: (
        isinstance(value, numbers.Integral)
        and not isinstance(value, bool)
        and value >= low
        and (high is None or value <= high)
    )


def _real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _reals(value) -> bool:
    return isinstance(value, list) and all(_real(v) for v in value)


FIELDS = {  # field -> (what it must be, the test); every field but REQUIRED may be absent
    "model": ("a model name", lambda v: _text(v) and bool(v)),
    "model_key": ("a text", _text),
    "method": ("a method label", lambda v: _text(v) and bool(v)),
    "resolved": ("a method as resolved", lambda v: _text(v) and bool(v)),
    "task": ("a task name", lambda v: _text(v) and bool(v)),
    "length": (f"a whole number of tokens 1 .. {MAX_LENGTH}", _integer(1, MAX_LENGTH)),
    "depth": ("null or a number 0 .. 1", lambda v: v is None or (_real(v) and 0 <= v <= 1)),
    "seed": ("a whole number >= 0", _integer(0)),
    "score": ("a finite number (null only with an error)", lambda v: v is None or _real(v)),
    "error": ("a text", _text),
    "metric": ("a text", _text),
    "window": ("a whole number >= 1", _integer(1)),
    "seconds": ("a finite number >= 0", lambda v: _real(v) and v >= 0),
    "batch": ("a whole number >= 1", _integer(1)),
    "prefill_tokens": ("a whole number >= 0", _integer(0)),
    "n_tokens": ("a whole number >= 0", _integer(0)),
    "max_new_tokens": ("a whole number >= 0", _integer(0)),
    "haystack_units": ("a whole number >= 0", _integer(0)),
    "searched_units": ("a whole number >= 0", _integer(0)),
    "empty": ("true or false", lambda v: isinstance(v, bool)),
    "answer": ("a text", _text),
    "machine": ("a text", _text),
    "dtype": ("a text", _text),
    "engine": ("an engine's name", lambda v: _text(v) and bool(v)),
    "engine_version": ("a text", _text),
    "parallel": ("a text", _text),
    "served_model": ("a text", _text),
    "prompt_hash": ("a text", _text),
    "references": ("a list", lambda v: isinstance(v, list)),
    "needle_depths": ("null or a list of numbers", lambda v: v is None or _reals(v)),
    "found": (
        "a list of true/false or numbers",
        lambda v: isinstance(v, list) and all(isinstance(x, bool) or _real(x) for x in v),
    ),
    "fraction": ("a number 0 .. 1", lambda v: _real(v) and 0 <= v <= 1),
    "log_ppl": ("a finite number", _real),
    "bucket_loss": ("a list of finite numbers", _reals),
    "bucket_edges": ("a list of numbers", _reals),
}
PERPLEXITY = ("log_ppl", "bucket_loss", "bucket_edges")  # what the report reads of a perplexity record


def problem(record) -> str | None:
    """What makes ``record`` unusable as a results record, in a few words; ``None`` if it is one."""
    if not isinstance(record, dict):
        return "not a JSON object"
    missing = [name for name in REQUIRED if name not in record]
    if not record.get("error"):
        missing += [name for name in ("metric",) if name not in record]
        if record.get("metric") == "perplexity":
            missing += [name for name in PERPLEXITY if name not in record]
    if missing:
        return f"missing {', '.join(missing)}"
    for name, value in record.items():
        if name in FIELDS and not FIELDS[name][1](value):
            return f"{name}={json.dumps(value)[:40]} is not {FIELDS[name][0]}"
    if record["score"] is None and not record.get("error"):
        return "score=null without an error"
    return None


def read_results(path: Path) -> list[dict]:
    """The records of a results file, each case once (the first wins: concurrent runs may both write it;
    a success wins over an error row). Invalid UTF-8 is read with replacement characters; a line that is
    not a record (:func:`problem`) is skipped with a warning on stderr naming its line number."""
    if not path.exists():
        return []
    records, seen = [], {}
    lines = path.read_bytes().decode("utf-8", errors="replace").splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number < len(lines) and not line.endswith(CUT_OFF):
                print(f"warning: {path}:{number} is not JSON; skipped: {line[:60]!r}", file=sys.stderr)
            continue
        if (wrong := problem(record)) is not None:
            print(f"warning: {path}:{number} is not a results record ({wrong}); skipped", file=sys.stderr)
            continue
        record.setdefault("resolved", record["method"])
        key = case_key(record)
        if key not in seen:
            seen[key] = len(records)
            records.append(record)
        elif records[seen[key]].get("error") and not record.get("error"):  # a rerun that succeeded replaces the error
            records[seen[key]] = record
    return records


class CaseKey(NamedTuple):
    """What makes a case: the model, the method, task, length, depth (``None``: the task draws its own) and seed.

    In the grid (:meth:`longreach.eval.grid.Grid.keys`) the model is the name given and the method its label;
    read from a record (:func:`case_key`) they are the model's identity and the method as resolved."""

    model: str
    method: str
    task: str
    length: int
    depth: float | None
    seed: int

    @property
    def case(self) -> tuple:
        """``(task, length, depth, seed)``: the prompt, the same under every method."""
        return self.task, self.length, self.depth, self.seed


def case_key(record: dict) -> CaseKey:
    """What makes a case: the model (its identity, see :func:`longreach.models.identity`; the name given,
    for records written before it was kept), the method as resolved (every parameter and L), task,
    length, depth, seed."""
    return CaseKey(
        record.get("model_key") or record["model"],
        record["resolved"],
        record["task"],
        record["length"],
        record["depth"],
        record["seed"],
    )


def end_cut_off_line(path: Path, sink) -> None:
    """Before appending to ``path`` (open as ``sink``): end a last line that a crash cut short with
    :data:`CUT_OFF`, so the next record stands alone and later reads skip that line without a warning."""
    with path.open("rb") as stream:
        if stream.seek(0, os.SEEK_END) == 0:
            return
        stream.seek(-1, os.SEEK_END)
        if stream.read(1) != b"\n":
            sink.write(CUT_OFF + "\n")

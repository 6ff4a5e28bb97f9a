"""The resumable grid runner: methods x tasks x lengths x depths x seeds -> one JSONL line per case.

Every finished case is appended to ``DIR/results.jsonl`` at once (flushed and synced), so a crash or
Ctrl-C loses nothing; a rerun with the same folder skips what is there (a truncated last line is
ignored and recomputed). Greedy decoding; a progress bar with ETA; ``limit`` caps the new cases.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from tqdm import tqdm

from .. import provenance
from . import ruler, tasks
from .distributed import World, shares
from .records import DTYPES, MAX_LENGTH, RESULTS, case_key, end_cut_off_line, read_results

MAX_SAMPLES = 10_000  # cases per (task, length, method): a pass rate's 95% interval is then within +-1 point


@dataclass(frozen=True)
class MethodSpec:
    """A method and its parameters as written on the command line: ``string:shift=2731,local_window=128``.

    Lists take ``;``: ``drop:rate=0.3,layers=0;1;2``. ``MethodSpec.parse(text)`` reads one."""

    name: str
    params: tuple[tuple[str, object], ...] = ()

    @classmethod
    def parse(cls, text: str) -> "MethodSpec":
        name, _, rest = text.partition(":")
        params = {}
        for item in filter(None, rest.split(",")):
            key, sep, value = item.partition("=")
            if not sep or not key.strip():
                raise ValueError(f"method parameter {item!r} must look like name=value (in {text!r})")
            if key.strip() in params:
                raise ValueError(f"method parameter {key.strip()!r} is given twice (in {text!r}); give it once")
            params[key.strip()] = parse_value(value.strip())
        if not name.strip():
            raise ValueError(f"--method {text!r} names no method; see `longreach methods`")
        return cls(name.strip(), tuple(sorted(params.items())))

    def arguments(self, training_window: int) -> tuple[str, dict]:
        """``(method, kwargs)`` for ``longreach.apply``.

        ``protocol=paper`` expands to the STRING paper's baseline set-up; ``position+frequency``
        (e.g. ``string+yarn:factor=2``) composes, routing each parameter to the method that has it.
        """
        from ..methods import base, paper_baseline, scaling

        params = dict(self.params)
        protocol = params.pop("protocol", None)
        if protocol not in (None, "paper"):
            raise ValueError(f"protocol={protocol!r} is not one of: paper")
        position, _, frequency = self.name.partition("+")
        if protocol:
            params = {**paper_baseline(frequency or position, training_window), **params}
        if not frequency:
            return position, params
        if frequency not in scaling.ALIASES:
            raise ValueError(f"after '+': {base.unknown(frequency, 'frequency method', list(scaling.PARAMETERS))}")
        names = scaling.PARAMETERS[scaling.ALIASES[frequency]]
        rescale = {"rope_type": frequency, **{k: v for k, v in params.items() if k in names}}
        return position, {"scaling": rescale, **{k: v for k, v in params.items() if k not in names}}

    def apply(self, model, training_window: int, **options) -> None:
        """Apply this method to ``model`` with ``L = training_window``, unless the spec names its own; ``options``
        are :func:`longreach.apply`'s own (``backend``, ``keep_moved_keys``)."""
        import longreach

        method, kwargs = self.arguments(training_window)
        longreach.apply(model, method, **{"training_window": training_window, **kwargs}, **options)

    @property
    def label(self) -> str:
        text = lambda v: ";".join(map(str, v)) if isinstance(v, tuple) else str(v)  # as parse reads it back
        return self.name + (":" + ",".join(f"{k}={text(v)}" for k, v in self.params) if self.params else "")


def parse_value(text: str):
    if ";" in text:  # a list, e.g. layers=0;1;2
        return tuple(parse_value(item) for item in text.split(";") if item)
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(text.lower(), text)


def parse_lengths(text: str) -> list[int]:
    """``2k,4k,8192`` -> ``[2048, 4096, 8192]`` (k = 1024)."""
    lengths = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        try:
            number = float(item[:-1]) * 1024 if item.lower().endswith("k") else float(item)
        except ValueError:
            number = 0.5
        if not math.isfinite(number) or number < 16 or number > MAX_LENGTH or number != int(number):
            raise ValueError(f"length {item!r} is out of range: a whole number of tokens from 16 to {MAX_LENGTH} (e.g. 2k, 4096)")
        lengths.append(int(number))
    if not lengths:
        raise ValueError("--lengths is empty: give e.g. 2k,4k,8k")
    return lengths


LENGTH_BOUND = 32  # lengths above 32 x L are refused: no method here is meant to reach that far


def check_lengths(lengths: list[int], window: int) -> None:
    """Refuse lengths above ``LENGTH_BOUND x L``; say so when lengths exceed L (methods that extrapolate are meant for that)."""
    if (too_long := [n for n in lengths if n > LENGTH_BOUND * window]):
        raise ValueError(f"--lengths {too_long[0]} is out of range: at most {LENGTH_BOUND} x L = {LENGTH_BOUND * window} tokens "
                         f"for this model (L = {window})")
    if (beyond := [n for n in lengths if n > window]):
        print(f"note: lengths {', '.join(map(str, beyond))} exceed the model's training window L = {window}")


def check_methods(methods: list[MethodSpec], config, training_window: int | None = None) -> None:
    """Apply each method to an empty (meta) model built from ``config``: every ``--method`` is checked, parameters and
    ranges included, before any weights load."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    import longreach

    with torch.device("meta"):
        empty = AutoModelForCausalLM.from_config(copy.deepcopy(config))
    window = training_window or longreach.training_window(config)
    for spec in methods:
        spec.apply(empty, window)


def depth_grid(count: int) -> list[float]:
    """``count`` depths evenly from 0 (start) to 1 (end)."""
    if count < 1:
        raise ValueError(f"--depths={count} is out of range: at least 1")
    return [0.5] if count == 1 else [round(i / (count - 1), 4) for i in range(count)]


@dataclass
class Grid:
    """Every case of an evaluation: ``samples`` cases per (task, length, method).

    Args:
        model: ``default``, a local folder or a hub id.
        tasks: task names (``niah4``, ``passkey``, ``ruler:vt``, ...).
        methods: the methods, each run on the same cases.
        lengths: lengths in tokens, everything included (prompt, template, tokens to generate).
        depths: for a task with a depth grid (``niah``): case ``i`` sits at ``depths[i % len(depths)]``;
            every other task draws its own needle positions, as upstream.
        samples: cases per task, length and method.
        training_window: ``L``; default the model's.
        dtype: ``auto`` (the checkpoint's own), ``float32``, ``bfloat16`` or ``float16``.
    """

    model: str
    tasks: list[str]
    methods: list[MethodSpec]
    lengths: list[int]
    depths: list[float]
    samples: int
    training_window: int | None = None  # None: the model's own L
    dtype: str = "auto"  # one of DTYPES

    def __post_init__(self) -> None:
        if not 1 <= self.samples <= MAX_SAMPLES:
            raise ValueError(f"--samples={self.samples} is out of range: 1 .. {MAX_SAMPLES}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype={self.dtype} is not one of: {', '.join(DTYPES)}")
        if self.training_window is not None and self.training_window < 2:
            raise ValueError(f"--training-window={self.training_window} is out of range: an integer >= 2 (tokens)")
        self.methods = list({m.label: m for m in self.methods}.values())  # --method rope --method rope: once
        for task in self.tasks:
            tasks.get(task)

    def __len__(self) -> int:
        return len(self.tasks) * len(self.lengths) * self.samples * len(self.methods)

    def keys(self) -> Iterator[tuple]:
        """Every case's key ``(model, method, task, length, depth, seed)``, made as they are read, longer
        lengths last (early results are the cheap ones)."""
        for task in self.tasks:
            grid = tasks.get(task).uses_depth
            for length, seed, method in itertools.product(self.lengths, range(self.samples), self.methods):
                depth = self.depths[seed % len(self.depths)] if grid else None
                yield self.model, method.label, task, length, depth, seed


def run(grid: Grid, out: Path, limit: int | None = None, loaded=None, batch_size: int = 1, tp: bool = False,
        prefill_tokens: int | None = None, command: str | None = None) -> Path:
    """Run the grid's missing cases (what ``longreach eval`` does), appending each to ``out/results.jsonl``.

    Cases already in the file are skipped, so a rerun resumes. Cases of one (task, length) are built
    once for every method. Under ``torchrun`` the cases are shared out over the processes, or with
    ``tp`` the model is (``longreach.eval.distributed``).

    Args:
        grid: every case to run.
        out: the results folder.
        limit: at most this many new cases (per process under ``torchrun``).
        loaded: a ``(model, tokenizer)`` already loaded, instead of ``grid.model``.
        batch_size: cases of one task, length and method decoded as one left-padded batch (the answers
            equal batch size 1's).
        tp: shard the model over the ``torchrun`` processes (tensor parallelism).
        prefill_tokens: read the prompts in chunks of at most this many tokens over the batch (0: in one
            forward; ``None``: 4096 for a batch, one forward for a lone case).
        command: the command line recorded in ``out/runs.jsonl`` (default: this process's, as ``longreach ...``).

    Returns:
        The path of ``results.jsonl``.
    """
    import torch

    import longreach
    from longreach import models

    if batch_size < 1:
        raise ValueError(f"--batch-size={batch_size} is out of range: at least 1")
    if prefill_tokens is not None and prefill_tokens < 0:
        raise ValueError(f"--prefill-tokens={prefill_tokens} is out of range: at least 0 (0: a prompt in one forward)")
    world = World.from_environment(tp)
    out.mkdir(parents=True, exist_ok=True)
    path = out / RESULTS
    specs = {m.label: m for m in grid.methods}
    if loaded is None:
        check_methods(grid.methods, models.load_config(grid.model), grid.training_window)  # in a second: a typo must not wait for the weights
    model, tokenizer = loaded or models.load(grid.model, dtype=grid.dtype if grid.dtype == "auto" else getattr(torch, grid.dtype),
                                             device=world.device(), tp=tp)
    if tokenizer is None and (text := [t for t in grid.tasks if not getattr(tasks.get(t), "token_ids", False)]):
        raise ValueError(f"model {grid.model} has no tokenizer (a probe checkpoint): {', '.join(text)} needs one; its tasks are "
                         "probe and probe-tail")
    dtype = str(model.dtype).removeprefix("torch.")
    window = grid.training_window or longreach.training_window(model.config)
    check_lengths(grid.lengths, window)
    resolved = {}
    for spec in grid.methods:  # validate every method before spending time; a case is keyed by the method as resolved
        spec.apply(model, window)
        resolved[spec.label] = longreach.describe(model)
    earlier = [r for file in [path, *shares(out, RESULTS)] for r in read_results(file)]
    check_dtype(earlier, dtype, out)
    model_key = models.identity(grid.model)
    # failed cases are tried again; records from before the model's identity was kept count under the name given
    done = {(r.get("model_key") or (model_key if r["model"] == grid.model else r["model"]), *case_key(r)[1:])
            for r in earlier if not r.get("error")}
    world.barrier()  # everyone has read what is done before anyone writes: tensor-parallel processes run the same cases
    mine, already, pending = 0, 0, []
    for key in world.share(grid.keys(), lambda key: key[2:]):
        mine += 1
        if (model_key, resolved[key[1]], *key[2:]) in done:
            already += 1
        elif limit is None or len(pending) < limit:
            pending.append(key)
    if world.writes:
        where = f"process {world.rank} of {world.size}: " if world.shares_cases else ""
        print(f"{where}{mine} cases in the grid, {already} already in {out}, running {len(pending)}")
    if pending:  # process 0 records who ran it, with what, on which model, as its first case is written
        this_run = provenance.run(grid.model, model.config, len(pending), world.size, command) if world.rank == 0 else None
        _run_cases(grid, pending, model, tokenizer, specs, resolved, window, batch_size, world, world.results_file(out, RESULTS), dtype,
                   prefill_tokens, model_key, this_run)
    longreach.remove(model)
    world.barrier()
    if world.rank == 0 and world.shares_cases:
        merge(out)
    return path


def merge(out: Path) -> None:
    """Append the records of the per-process files (data parallel) to ``results.jsonl``, then remove them."""
    path, left = out / RESULTS, shares(out, RESULTS)
    good = {case_key(r) for r in read_results(path) if not r.get("error")}
    with path.open("a", encoding="utf-8") as sink:
        end_cut_off_line(path, sink)
        for share in left:
            for record in read_results(share):
                if case_key(record) not in good:
                    sink.write(json.dumps(record) + "\n")
        sink.flush()
        os.fsync(sink.fileno())
    for share in left:
        share.unlink()


def check_dtype(records: list[dict], dtype: str, out: Path) -> None:
    """A results folder holds one precision: resuming it in another would mix two measurements."""
    held = {r.get("dtype", "float32") for r in records}  # records from before the field was kept ran in float32
    if held - {dtype}:
        raise ValueError(f"--dtype resolves to {dtype}, but {out} holds results in {', '.join(sorted(held))}: "
                         f"resume it with that --dtype, or give another --out")


def _run_cases(grid, pending, model, tokenizer, specs, resolved, window, batch_size, world, path, dtype, prefill_tokens,
               model_key, this_run: dict | None) -> None:
    """Run ``pending`` cases, one JSON line each in ``path`` (only where ``world`` writes); ``this_run`` (process 0's) goes
    into the folder's ``runs.jsonl`` with the first case, so a run that fails before it leaves nothing behind."""
    state = {"applied": None}

    def apply(label: str) -> None:
        if state["applied"] != label:
            specs[label].apply(model, window)
            state["applied"] = label

    machine = _machine(model)
    desc = f"cases (process {world.rank})" if world.shares_cases else "cases"
    with (path.open("a", encoding="utf-8") if world.writes else contextlib.nullcontext()) as sink, \
            tqdm(total=len(pending), desc=desc, unit="case", position=world.rank if world.shares_cases else 0, disable=not world.writes) as bar:
        if sink:
            end_cut_off_line(path, sink)
        for (task_name, length), keys in itertools.groupby(pending, key=lambda key: (key[2], key[3])):
            keys, task = list(keys), tasks.get(task_name)
            cases = list(dict.fromkeys((key[4], key[5]) for key in keys))  # (depth, seed), in grid order
            size = 1 if hasattr(task, "evaluate") else batch_size
            for chunk in (cases[i : i + size] for i in range(0, len(cases), size)):
                start = time.perf_counter()
                built = {where: _build(task, tokenizer, length, *where) for where in chunk}
                build_seconds = (time.perf_counter() - start) / len(chunk)
                for label in specs:
                    batch = [key for key in keys if key[1] == label and (key[4], key[5]) in built]
                    if not batch:
                        continue
                    bar.set_postfix_str(f"{task_name} {length} {label}")
                    results = _run_batch(task, model, tokenizer, [built[key[4], key[5]] for key in batch], lambda: apply(label),
                                         prefill_tokens)
                    for key, (record, seconds) in zip(batch, results):
                        _, _, _, _, depth, seed = key
                        if record.get("error"):
                            bar.write(f"case {task_name} {length} {label} seed {seed} failed: {record['error']}")
                        decoded_with = record.pop("batch", len(batch))
                        record = {"model": grid.model, "model_key": model_key, "method": label, "resolved": resolved[label], "window": window,
                                  "task": task_name, "length": length, "depth": depth, "seed": seed, **record,
                                  "seconds": round(seconds + build_seconds, 3), "batch": decoded_with, "machine": machine, "dtype": dtype}
                        if sink:
                            if this_run is not None:
                                provenance.record(path.parent, this_run)
                                this_run = None
                            sink.write(json.dumps(record) + "\n")
                            sink.flush()
                            os.fsync(sink.fileno())
                        bar.update()


def _machine(model) -> str:
    """What ran the cases, for the time per case: 'cpu' or the GPU's name, e.g. 'cuda: NVIDIA H100 80GB HBM3'."""
    import torch

    return f"cuda: {torch.cuda.get_device_name(model.device)}" if model.device.type == "cuda" else model.device.type


def _build(task, tokenizer, length: int, depth, seed: int):
    """The case, or the error that building it raised (an error row for every method, the grid goes on)."""
    try:
        return task.build(tokenizer, length, depth, seed)
    except Exception as error:
        return error


def _error(error: BaseException) -> dict:
    return {"score": None, "error": f"{error.__class__.__name__}: {error}"}


def _run_batch(task, model, tokenizer, cases: list, apply, prefill_tokens: int | None) -> list[tuple[dict, float]]:
    """``(record fields, seconds)`` per case: decoded together; a case that could not be built, or a
    batch that raises, becomes error rows (one failing case must not stop the grid; a rerun retries).
    A method whose frequencies follow the forward's longest sequence (dynamic NTK) decodes each case
    alone, in one forward: its answer is then its own, whatever the batch size and prefill budget."""
    from ..integrations.transformers import one_case_per_forward
    from . import generate

    ready = [case for case in cases if not isinstance(case, Exception)]
    start = time.perf_counter()
    try:
        apply()
        if hasattr(task, "evaluate"):
            outcomes = [task.evaluate(model, tokenizer, case) for case in ready]
        else:
            alone = one_case_per_forward(model) and len(ready) > 1
            budget = 0 if one_case_per_forward(model) else generate.prefill_budget(len(ready), prefill_tokens)
            groups = [[case] for case in ready] if alone else [ready] if ready else []
            answers = [a for group in groups for a in generate.greedy(model, tokenizer, [c.prompt for c in group], task.max_new_tokens, budget)]
            outcomes = [{"answer": answer, "empty": not ruler.postprocess(answer), "prefill_tokens": budget, **({"batch": 1} if alone else {}),
                         **task.score(answer, case)} for answer, case in zip(answers, ready)]
    except Exception as error:
        outcomes = [_error(error)] * len(ready)
    seconds = (time.perf_counter() - start) / max(1, len(ready))
    outcome = iter(outcomes)
    results = []
    for case in cases:
        if isinstance(case, Exception):
            results.append((_error(case), 0.0))
        else:
            fields = next(outcome)
            if not fields.get("error"):
                fields = {"n_tokens": case.n_tokens, "max_new_tokens": case.max_new_tokens, "haystack_units": case.haystack_units,
                          **({"searched_units": case.searched_units} if case.searched_units is not None else {}),
                          "prompt_hash": hashlib.sha256(case.prompt.encode()).hexdigest()[:16], "references": case.references,
                          "needle_depths": case.needle_depths, "metric": case.metric, **fields}
            results.append((dict(fields), seconds))
    return results

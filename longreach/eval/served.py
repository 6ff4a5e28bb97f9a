"""``longreach eval`` on a serving engine: vLLM's offline engine (``--engine vllm``) or an OpenAI-compatible server
(``--server URL``, :mod:`.server`).

The same grid, cases, records, resume and report as the transformers engine (:mod:`.runner`); the weights are the
engine's, so this process loads only the config (every ``--method`` checked on an empty model first) and the
tokenizer, which builds the prompts as the transformers engine does. The cases run method by method, since an engine
holds one method; a results folder holds one engine (each record says which, its version and its parallel layout).

``--dp N`` runs N engines side by side, each in a process of its own with its share of the cases (case ``i`` to
process ``i mod N``, as under ``torchrun``) and, on GPUs, its own ``tp x pp`` devices; the shares are merged when
every process is done, and a crash leaves them for the next run to count and merge.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from .. import models, provenance
from . import specs
from .cases import Setting, run_cases
from .distributed import World, shares
from .records import RESULTS, read_results

DP_RANK, DP_SIZE = "LONGREACH_DP_RANK", "LONGREACH_DP_SIZE"  # a data-parallel child's place, set by its parent


@dataclass(frozen=True)
class Parallel:
    """vLLM's parallel sizes: tensor, pipeline, and data (engines side by side)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1


def run(
    grid,
    out: Path,
    engine: str = "vllm",
    parallel: Parallel = Parallel(),
    server=None,
    limit: int | None = None,
    batch_size: int = 64,
    command: str | None = None,
    argv: list[str] | None = None,
) -> Path:
    """Run the grid's missing cases on ``engine`` (``"vllm"``, or ``"server"`` with ``server`` a
    :class:`.server.Server`), ``batch_size`` cases submitted at a time; returns the path of ``results.jsonl``.
    ``argv``: this command's arguments, which ``--dp``'s processes run again."""
    from ..integrations.transformers import training_window
    from .runner import _finished, check_dtype, check_engine, check_lengths, merge

    if parallel.dp > 1 and DP_RANK not in os.environ:
        return _data_parallel(parallel, out, argv if argv is not None else sys.argv[1:])
    world = World(int(os.environ.get(DP_RANK, "0")), int(os.environ.get(DP_SIZE, "1")))
    out.mkdir(parents=True, exist_ok=True)
    config = models.load_config(grid.model)
    window = grid.training_window or training_window(config)
    check_lengths(grid.lengths, window)
    labels = {m.label: m for m in grid.methods}
    path = out / RESULTS
    earlier = [r for file in [path, *shares(out, RESULTS)] for r in read_results(file)]
    check_engine(earlier, engine, out)  # first: another engine's folder says so, before this one is set up
    if engine == "vllm":
        resolved = specs.check(grid.methods, config, window)  # every --method, before any engine starts
        decoder = _vllm(grid, config, labels, window, parallel)
    else:  # the server's method is its own: its label stands for it
        resolved, decoder = {label: label for label in labels}, server
    check_dtype(earlier, decoder.dtype, out)
    key = models.identity(grid.model)
    setting = Setting(grid.model, key, window, decoder.dtype, labels, resolved, batch_size, None)
    done = _finished(earlier, grid.model, setting.model_key)
    keys = list(world.share(grid.keys(), lambda key: key.case))
    pending = [k for k in keys if k._replace(model=setting.model_key, method=resolved[k.method]) not in done]
    order = list(labels)
    pending = sorted(pending, key=lambda key: order.index(key.method))[:limit]  # an engine holds one method
    where = f"process {world.rank} of {world.size}: " if world.shares_cases else ""
    print(f"{where}{len(keys)} cases in the grid, {len(keys) - len(pending)} already in {out}, running {len(pending)}")
    try:
        if pending:
            this_run = provenance.run(grid.model, config, len(pending), world.size, command) if not world.rank else None
            run_cases(setting, pending, decoder, world, world.results_file(out, RESULTS), this_run)
    finally:
        decoder.close()
    if world.size == 1 and shares(out, RESULTS):  # shares an interrupted --dp run left
        merge(out)
    return path


def _vllm(grid, config, labels: dict, window: int, parallel: Parallel):
    """The vLLM engine for the grid: the model's own tokenizer, the checkpoint's own precision for ``auto`` (where
    vLLM's ``auto`` would run a float32 checkpoint in float16 on a GPU)."""
    from transformers import AutoTokenizer

    from .engines import Vllm

    source = models.source_of(grid.model)
    dtype = grid.dtype if grid.dtype != "auto" else str(getattr(config, "dtype", None) or "float32")
    dtype = dtype.removeprefix("torch.")
    tokenizer = AutoTokenizer.from_pretrained(source)
    return Vllm(source, tokenizer, labels, window, dtype, max(grid.lengths), parallel.tp, parallel.pp, parallel.dp)


def _data_parallel(parallel: Parallel, out: Path, argv: list[str]) -> Path:
    """This command again in ``dp`` processes, each with its share of the cases and its own devices (GPUs) or cores
    (CPU); their shares merged once all are done. A process that fails: one line, the shares kept for a rerun."""
    from .runner import merge

    children = []
    for rank in range(parallel.dp):
        env = {**os.environ, DP_RANK: str(rank), DP_SIZE: str(parallel.dp), **_devices(rank, parallel)}
        children.append(subprocess.Popen([sys.executable, "-m", "longreach", *argv], env=env))
    failed = [rank for rank, child in enumerate(children) if child.wait() != 0]
    if failed:
        raise RuntimeError(
            f"--dp {parallel.dp}: process {', '.join(map(str, failed))} failed (its output is above); what "
            f"finished is in {out}: run the same command again to go on"
        )
    merge(out)
    return out / RESULTS


def _devices(rank: int, parallel: Parallel) -> dict[str, str]:
    """A data-parallel process's own ``tp x pp`` GPUs, or its share of the CPU's cores for vLLM's CPU workers."""
    import torch

    per = parallel.tp * parallel.pp
    if torch.cuda.is_available():
        every = ",".join(map(str, range(torch.cuda.device_count())))
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", every).split(",")
        if len(visible) < per * parallel.dp:
            raise ValueError(
                f"--dp {parallel.dp} x --tp {parallel.tp} x --pp {parallel.pp} needs {per * parallel.dp} GPUs; "
                f"{len(visible)} are visible"
            )
        return {"CUDA_VISIBLE_DEVICES": ",".join(visible[rank * per : (rank + 1) * per])}
    cores = sorted(os.sched_getaffinity(0))
    share = max(1, len(cores) // parallel.dp)
    mine = cores[rank * share : (rank + 1) * share] or cores[-1:]
    workers = [mine[i * len(mine) // per : (i + 1) * len(mine) // per] or mine[-1:] for i in range(per)]
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(",".join(map(str, w)) for w in workers)}

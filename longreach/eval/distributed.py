"""Evaluations over several processes: started by ``torchrun`` (the transformers engine), or by ``--dp`` (vLLM's
engines side by side, :func:`data_parallel`).

* Data parallel (the default under ``torchrun``): each process loads the whole model and runs its own
  share of the grid's cases -- case ``i`` of the grid belongs to process ``i mod N``, fixed by the grid
  alone, so every case runs exactly once whatever each process finds already done -- appending to its
  own ``results.rankR.jsonl``. When all are done, process 0 merges the shares into ``results.jsonl``.
  A crash leaves the shares in place; a rerun counts them as done and merges them.
* Tensor parallel (``--tp``): the model is sharded over the processes (transformers' ``tp_plan``), so
  every process runs every case in the same order; process 0 alone writes and shows progress.
* ``--dp N`` (vLLM): this command runs again in N processes, each an engine with its share of the cases (as under
  ``torchrun``) and, on GPUs, its own ``tp x pp`` devices; the parent merges the shares when every process is done,
  and a crash leaves them for the next run to count and merge.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from ..models import tensor_parallel_processes

DP_RANK, DP_SIZE = "LONGREACH_DP_RANK", "LONGREACH_DP_SIZE"  # a data-parallel child's place, set by its parent


@dataclass(frozen=True)
class World:
    """This process's place among ``size`` processes (``size == 1``: no ``torchrun``)."""

    rank: int = 0
    size: int = 1
    tp: bool = False
    joined: bool = True  # torchrun's processes wait for each other; --dp's children do not, their parent merges

    @classmethod
    def from_environment(cls, tp: bool = False) -> World:
        """This process under ``torchrun`` (or alone)."""
        size = tensor_parallel_processes() if tp else int(os.environ.get("WORLD_SIZE", "1"))
        return cls(int(os.environ.get("RANK", "0")), size, tp)

    @classmethod
    def from_data_parallel(cls) -> World:
        """This process as a child of ``--dp`` (or alone)."""
        return cls(int(os.environ.get(DP_RANK, "0")), int(os.environ.get(DP_SIZE, "1")), joined=False)

    @property
    def shares_cases(self) -> bool:
        """Data parallel: several processes, each running its own share of the cases."""
        return self.size > 1 and not self.tp

    @property
    def writes(self) -> bool:
        """Whether this process writes results (all do in data parallel; process 0 alone in tensor parallel)."""
        return self.rank == 0 or not self.tp

    @property
    def merges(self) -> bool:
        """Whether this process merges the shares into one results file when its cases are done: a lone process
        (shares an interrupted run left), or process 0 of ``torchrun``'s after the barrier."""
        return self.size == 1 or (self.rank == 0 and self.shares_cases and self.joined)

    def results_file(self, out: Path, name: str) -> Path:
        if not self.shares_cases:
            return out / name
        stem, dot, suffix = name.rpartition(".")
        return out / f"{stem}.rank{self.rank}{dot}{suffix}"

    def share(self, keys: Iterable[tuple], case_of) -> Iterator[tuple]:
        """The grid keys this process runs, as they come: all of them in tensor parallel, else those whose
        case (``case_of(key)``, every method of one prompt together) has index ``rank`` modulo ``size``
        in the order cases first appear."""
        index: dict = {}
        for key in keys:
            case = case_of(key)
            if not self.shares_cases or index.setdefault(case, len(index)) % self.size == self.rank:
                yield key

    def barrier(self) -> None:
        """Wait for every process (a gloo group is started when transformers has not started one)."""
        if self.size == 1 or not self.joined:
            return
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo")
        dist.barrier()

    def device(self) -> str:
        """Where a whole model goes: this process's GPU (``LOCAL_RANK``) when there is one, else the CPU."""
        if torch.cuda.is_available():
            return f"cuda:{int(os.environ.get('LOCAL_RANK', '0')) % torch.cuda.device_count()}"
        return "cpu"


def shares(out: Path, name: str) -> list[Path]:
    """The per-process results files left in ``out`` (``results.rank0.jsonl`` ...)."""
    stem, _, suffix = name.rpartition(".")
    return sorted(out.glob(f"{stem}.rank*.{suffix}"))


@dataclass(frozen=True)
class Parallel:
    """vLLM's parallel sizes: tensor, pipeline, and data (engines side by side)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1

    @property
    def layout(self) -> str:
        """As a record keeps it: ``tp=2 pp=1 dp=4``."""
        return f"tp={self.tp} pp={self.pp} dp={self.dp}"


def is_data_parallel_child() -> bool:
    """Whether this process is one of ``--dp``'s (which leaves the report to its parent)."""
    return DP_RANK in os.environ


def data_parallel(parallel: Parallel, out: Path, argv: list[str], merge) -> None:
    """This command (``argv``: its arguments) again in ``parallel.dp`` processes, each with its share of the cases and
    its own devices (GPUs) or cores (CPU); ``merge(out)`` once all are done. A process that fails: one line, the shares
    kept for a rerun."""
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


def _devices(rank: int, parallel: Parallel) -> dict[str, str]:
    """A data-parallel process's own ``tp x pp`` GPUs, or its share of the CPU's cores for vLLM's CPU workers."""
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

"""Evaluations over several processes started by ``torchrun``.

* Data parallel (the default under ``torchrun``): each process loads the whole model and runs its own
  share of the grid's cases -- case ``i`` of the grid belongs to process ``i mod N``, fixed by the grid
  alone, so every case runs exactly once whatever each process finds already done -- appending to its
  own ``results.rankR.jsonl``. When all are done, process 0 merges the shares into ``results.jsonl``.
  A crash leaves the shares in place; a rerun counts them as done and merges them.
* Tensor parallel (``--tp``): the model is sharded over the processes (transformers' ``tp_plan``), so
  every process runs every case in the same order; process 0 alone writes and shows progress.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import torch

from ..models import tensor_parallel_processes


@dataclass(frozen=True)
class World:
    """This process's place among ``size`` processes (``size == 1``: no ``torchrun``)."""

    rank: int = 0
    size: int = 1
    tp: bool = False

    @classmethod
    def from_environment(cls, tp: bool = False) -> "World":
        size = tensor_parallel_processes() if tp else int(os.environ.get("WORLD_SIZE", "1"))
        return cls(int(os.environ.get("RANK", "0")), size, tp)

    @property
    def shares_cases(self) -> bool:
        """Data parallel: several processes, each running its own share of the cases."""
        return self.size > 1 and not self.tp

    @property
    def writes(self) -> bool:
        """Whether this process writes results (all do in data parallel; process 0 alone in tensor parallel)."""
        return self.rank == 0 or not self.tp

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
        if self.size == 1:
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

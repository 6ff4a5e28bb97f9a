"""The probe as a task of ``longreach eval`` and ``longreach tune``: a probe checkpoint (no tokenizer; its
prompts are token ids) scored by the 4-needle retrieval case of :func:`.corpus.retrieval_case`.

``probe`` cycles its cases over the 16 distances of :func:`.measure.distances` (case ``s`` at distance
``s mod 16``); ``probe-tail`` over those in the last third of the window, the undertrained tail where STRING
helps. A case passes when the greedy next token after ``ASK k`` is the record's value (score 100, else 0).

Importing this module registers both in ``longreach eval``'s task registry (:func:`longreach.eval.tasks.register`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from ..eval import tasks
from ..eval.case import Case
from ..eval.task_protocol import EVALUATE
from . import measure
from .corpus import RECORD, retrieval_case


@dataclass(frozen=True)
class ProbeRetrieval:
    """4-needle retrieval on a probe checkpoint, the window being the case's length."""

    name: str
    kind: ClassVar[str] = EVALUATE
    token_ids: ClassVar[bool] = True  # its prompts are token ids: it needs no tokenizer
    tail: bool = False
    uses_depth: bool = False
    max_new_tokens: int = 0
    metric: str = "probe_retrieval"

    def distances(self, length: int) -> list[int]:
        grid = measure.distances(length)
        return [d for d in grid if d >= 2 * length / 3] if self.tail else grid

    def build(self, tokenizer, length: int, depth: float | None, seed: int) -> Case:
        grid = self.distances(length)
        distance = grid[seed % len(grid)]
        tokens, _, answer = retrieval_case(length, distance, measure.NEEDLES, np.random.default_rng([seed, distance]))
        prompt = " ".join(map(str, tokens.tolist()))
        return Case(
            self.name,
            length,
            depth,
            seed,
            prompt,
            [str(answer)],
            0,
            len(tokens),
            metric=self.metric,
            needle_depths=[1 - distance / length],
            haystack_units=length,
        )

    @torch.no_grad()
    def evaluate(self, model, tokenizer, case: Case) -> dict:
        ids = torch.tensor([[int(t) for t in case.prompt.split()]], device=model.device)
        predicted = int(model(input_ids=ids).logits[0, ids.shape[1] - RECORD + 1].argmax())  # after ASK k
        return {"score": 100.0 * (predicted == int(case.references[0])), "answer": str(predicted)}


TASKS = {"probe": ProbeRetrieval("probe"), "probe-tail": ProbeRetrieval("probe-tail", tail=True)}
tasks.register(TASKS, "a probe checkpoint's retrieval")

"""Perplexity of long text with the loss per position bucket (the ``ppl`` task).

The text is a window of Paul Graham's essays (or any text file) of the requested token length,
starting at a seeded character offset. The loss of every next-token prediction is computed in one forward
pass; the vocabulary projection runs in chunks so that no ``[n, vocab]`` logits tensor is built.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass
from typing import ClassVar

import torch

from . import haystack
from .case import Case
from .task_protocol import EVALUATE


@dataclass(frozen=True)
class Perplexity:
    name: str = "ppl"
    kind: ClassVar[str] = EVALUATE
    token_ids: ClassVar[bool] = False
    buckets: int = 8
    uses_depth: bool = False
    max_new_tokens: int = 0

    def build(self, tokenizer, length: int, depth: float | None, seed: int, text: str | None = None) -> Case:
        text = text or haystack.essays()
        span = 16 * length + 64  # characters: more than `length` tokens of any tokenizer's text
        text = text * (span // len(text) + 1) if len(text) < span else text
        start = random.Random(f"ppl/{length}/{seed}").randrange(len(text) - span + 1)
        ids = tokenizer(text[start : start + span], add_special_tokens=False)["input_ids"]
        ids = ids * (length // len(ids) + 1) if len(ids) < length else ids
        window = tokenizer.decode(ids[:length])
        n = len(tokenizer(window, add_special_tokens=False)["input_ids"])
        return Case(self.name, length, None, seed, window, [], 0, n, metric="perplexity")

    @torch.no_grad()
    def evaluate(self, model, tokenizer, case: Case, chunk: int = 1024) -> dict:
        ids = tokenizer(case.prompt, return_tensors="pt", add_special_tokens=False)["input_ids"].to(model.device)
        hidden = model.get_decoder()(input_ids=ids).last_hidden_state[0, :-1]
        targets = ids[0, 1:]
        softcap = getattr(model.config, "final_logit_softcapping", None)
        losses = []
        for start in range(0, hidden.shape[0], chunk):
            logits = model.get_output_embeddings()(hidden[start : start + chunk]).float()
            if softcap:
                logits = softcap * torch.tanh(logits / softcap)
            losses.append(torch.nn.functional.cross_entropy(logits, targets[start : start + chunk], reduction="none"))
        loss = torch.cat(losses)
        edges = torch.linspace(0, loss.numel(), self.buckets + 1).long().tolist()
        per_bucket = [loss[a:b].mean().item() for a, b in itertools.pairwise(edges)]
        mean = loss.mean().item()
        return {
            "score": math.exp(mean),
            "log_ppl": mean,
            "bucket_edges": edges,
            "bucket_loss": per_bucket,
            "answer": "",
        }

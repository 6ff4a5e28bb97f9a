"""RULER's needle-in-a-haystack tasks (``scripts/data/synthetic/niah.py``)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar

from .. import haystack, string_match
from ..case import Case
from ..haystack import NOISE
from ..task_protocol import GENERATE
from .common import (
    DEPTHS,
    FIXED_SEED,
    case,
    essay_sentences,
    fit,
    insert_at_sentences,
    postprocess,
    random_value,
    stream_name,
)

NIAH_TEMPLATE = (
    "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {type_needle_v} afterwards.\n{context}\n"
    "What are all the special magic {type_needle_v} for {query} mentioned in the provided text?"
)
NIAH_ANSWER = " The special magic {type_needle_v} for {query} mentioned in the provided text are"
NIAH_NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."


@dataclass(frozen=True)
class Niah:
    """RULER's niah family (``niah.py``): needles ``One of the special magic ...`` in essays, noise or needles.

    ``grid_depth``: the one needle goes at the case's grid depth instead of a depth drawn from
    ``DEPTHS`` -- the ``niah`` heatmap task (RULER's niah_single_2 otherwise).
    """

    name: str
    kind: ClassVar[str] = GENERATE
    token_ids: ClassVar[bool] = False
    templated: ClassVar[bool] = True  # its prompt is RULER's model template around the task text
    haystack: str = "essay"  # essay, noise or needle
    type_k: str = "words"
    type_v: str = "numbers"
    num_k: int = 1
    num_v: int = 1
    num_q: int = 1
    grid_depth: bool = False
    max_new_tokens: int = 128
    metric: str = "string_match_all"
    packing: str = "ruler"

    @property
    def uses_depth(self) -> bool:
        return self.grid_depth

    def build(self, tokenizer, length: int, depth: float | None, seed: int) -> Case:
        details = {}

        def prompt_of(n: int, stream: str) -> str:
            rng = random.Random(f"{stream_name(self)}/{length}/{stream}")
            user, answer, *details[stream] = self._generate(rng, n, depth)
            return haystack.with_bos(tokenizer, haystack.templated(tokenizer, user, answer))

        start = {"essay": length // 2, "noise": length // 25, "needle": length // 20}[self.haystack]
        step = 500 if self.haystack == "essay" else 5 if length < 4096 else 25  # niah.py's incremental
        built = fit(
            self,
            tokenizer,
            length,
            seed,
            prompt_of,
            haystack.RulerSearch(step),
            start=start,
            unit="essay words" if self.haystack == "essay" else f"{self.haystack} lines",
        )
        answers, depths = details[f"{seed}/{built[0]}"]
        return case(self, length, seed, built, answers, depth if self.grid_depth else None, needle_depths=depths)

    def _generate(self, rng: random.Random, n: int, grid_depth: float | None):
        """RULER's ``generate_input_output(n)``: (user message, answer prefix, answers, needle depths in [0, 1])."""
        num_k = max(self.num_k, self.num_q)
        keys, values, needles = [], [], []
        for _ in range(num_k):
            keys.append(random_value(rng, self.type_k))
            values.append([])
            for _ in range(self.num_v):
                values[-1].append(random_value(rng, self.type_v))
                needles.append(NIAH_NEEDLE.format(type_needle_v=self.type_v, key=keys[-1], value=values[-1][-1]))
        random.Random(FIXED_SEED).shuffle(needles)
        if self.haystack == "essay":
            percents = [100 * grid_depth] if self.grid_depth else rng.sample(DEPTHS, len(needles))
            context = insert_at_sentences(essay_sentences(n), needles, percents)
            depths = [p / 100 for p in sorted(percents)]
        else:
            if self.haystack == "noise":
                lines = [NOISE] * n
            else:
                lines = [
                    NIAH_NEEDLE.format(
                        type_needle_v=self.type_v,
                        key=random_value(rng, self.type_k),
                        value=random_value(rng, self.type_v),
                    )
                    for _ in range(n)
                ]
            indexes = sorted(rng.sample(range(n), min(n, len(needles))), reverse=True)
            # not strict: a haystack of fewer lines than needles places the first ones only
            for index, needle in zip(indexes, needles, strict=False):
                lines.insert(index, needle)
            context = "\n".join(lines)
            depths = [index / n for index in indexes]
        asked = rng.sample(range(num_k), self.num_q)
        queries = [keys[i] for i in asked]
        answers = [v for i in asked for v in values[i]]
        query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
        template, answer, type_v = NIAH_TEMPLATE, NIAH_ANSWER, self.type_v
        if self.num_q * self.num_v == 1:  # RULER's rewording for a single value
            for plural, single in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
                template, answer = template.replace(plural, single), answer.replace(plural, single)
            type_v = type_v[:-1]
        # not strict: only the needles placed have depths (a haystack of fewer lines than needles holds the first)
        by_value = dict(zip((needle.rsplit(" ", 1)[-1][:-1] for needle in needles), depths, strict=False))
        return (
            template.format(type_needle_v=type_v, context=context, query=query),
            answer.format(type_needle_v=type_v, query=query),
            answers,
            [by_value[a] for a in answers],
        )

    def score(self, answer: str, case: Case) -> dict:
        prediction = postprocess(answer)
        return {
            "score": string_match.string_match_all(prediction, case.references),
            "found": string_match.needles_found(prediction, case.references),
        }

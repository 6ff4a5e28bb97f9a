"""RULER's variable tracking (``scripts/data/synthetic/variable_tracking.py``)."""

from __future__ import annotations

import random
import string
from dataclasses import dataclass
from typing import ClassVar

from .. import haystack, string_match
from ..case import Case
from ..haystack import NOISE
from ..task_protocol import GENERATE
from .common import case, fit, postprocess, stream_name

VT_TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
    "Question: Find all variables that are assigned the value {query} in the text above."
)
VT_ANSWER = (
    " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
    "assigned the value {query}, they are: "
)


def _noise_with_lines(rng: random.Random, n: int, chain: list[str]) -> str:
    """vt's noise haystack: ``n`` noise lines, the chain's lines inserted in order at random lines."""
    lines = [NOISE] * n
    positions = sorted(rng.sample(range(n), min(n, len(chain))))
    for j, at in enumerate(positions):
        lines.insert(at + j, chain[j])
    return "\n".join(lines).replace(". \n", ".\n")


def _chain(rng: random.Random, hops: int, icl: bool) -> tuple[list[str], list[str]]:
    """RULER's ``generate_chains`` for one chain: names (5 letters; 3 in the example) and its lines.

    Names that repeat are a :class:`.haystack.Redraw`: upstream then draws more names, which make a second, short
    chain whose lines raise ``IndexError``, and its sample loop draws again ``incremental`` units smaller."""
    k = 3 if icl else 5
    hops = min(10, hops) if icl else hops
    names = ["".join(rng.choices(string.ascii_uppercase, k=k)) for _ in range(hops + 1)]
    if len(set(names)) < hops + 1:
        raise haystack.Redraw(f"the chain's names repeat: {names}")
    value = "12345" if icl else str(rng.randrange(10000, 99999))
    return names, [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(hops)]


@dataclass(frozen=True)
class VariableTracking:
    """RULER ``vt`` (``variable_tracking.py``): one chain of 4 hops in noise, after one in-context example."""

    name: str = "ruler:vt"
    kind: ClassVar[str] = GENERATE
    token_ids: ClassVar[bool] = False
    templated: ClassVar[bool] = True  # its prompt is RULER's model template around the task text
    hops: int = 4
    uses_depth: bool = False
    max_new_tokens: int = 30
    metric: str = "string_match_all"
    example_length: int = 500  # RULER builds its example at max_seq_length=500, nothing to generate
    packing: str = "ruler"

    def build(self, tokenizer, length: int, depth: float | None, seed: int) -> Case:
        example = self._example(tokenizer, length, seed)
        details = {}

        def prompt_of(n: int, stream: str, with_example: bool = True) -> str:
            rng = random.Random(f"{stream_name(self)}/{length}/{stream}")
            names, chain = _chain(rng, self.hops, icl=False)
            value = chain[0].split("=")[-1].strip()
            user = VT_TEMPLATE.format(context=_noise_with_lines(rng, n, chain), query=value)
            details[stream] = names
            if with_example:
                user = _randomize(example, self.hops, rng) + "\n" + user
            return haystack.with_bos(
                tokenizer, haystack.templated(tokenizer, user, VT_ANSWER.format(num_v=self.hops + 1, query=value))
            )

        # RULER's search counts the example's tokens apart, unrenamed (variable_tracking.py's example_tokens)
        search_budget = length - self.max_new_tokens - haystack.count_tokens(tokenizer, example)
        step = 5 if length < 4096 else 10

        def searched(n, stream):
            return prompt_of(n, stream, with_example=not stream.startswith("search"))

        built = fit(
            self,
            tokenizer,
            length,
            seed,
            searched,
            haystack.RulerSearch(step),
            start=length // 25,
            least=self.hops + 1,
            unit="noise lines",
            budget=search_budget,
        )
        return case(self, length, seed, built, details[f"{seed}/{built[0]}"])

    def _example(self, tokenizer, length: int, seed: int) -> str:
        """The in-context example: a 3-letter chain valued 12345 in noise, at most 500 tokens of RULER's
        ``base`` template, followed by its answer; one per run (upstream's), one per case when packed tight."""
        names = {}

        def prompt_of(n: int, stream: str) -> str:
            rng = random.Random(f"{stream_name(self)}/example/{stream}")
            names[stream], chain = _chain(rng, self.hops, icl=True)
            return VT_TEMPLATE.format(context=_noise_with_lines(rng, n, chain), query="12345") + VT_ANSWER.format(
                num_v=self.hops + 1, query="12345"
            )

        what, least = "the vt example", self.hops + 1
        if self.packing == "tight":
            run = f"{length}/{seed}"
            n, text, _ = haystack.fit_largest(
                tokenizer,
                self.example_length,
                lambda n: prompt_of(n, f"{run}/{n}"),
                start=20,
                least=least,
                what=what,
                unit="noise lines",
            )
        else:
            run = "run"
            n, text, *_ = haystack.fit_as_ruler(
                tokenizer,
                self.example_length,
                self.example_length,
                lambda n: prompt_of(n, f"run/{n}"),
                lambda n: prompt_of(n, f"search/{n}"),
                haystack.RulerSearch(5),
                (self.name, "example"),
                what=what,
                unit="noise lines",
            )
        return text + " " + " ".join(names[f"{run}/{n}"]) + "\n"

    def score(self, answer: str, case: Case) -> dict:
        return {"score": string_match.string_match_all(postprocess(answer), case.references)}


def _randomize(example: str, hops: int, rng: random.Random) -> str:
    """RULER's ``randomize_icl``: new names for the example's answer variables, a new value for 12345."""
    for name in example.strip().split()[-hops - 1 :]:
        example = example.replace(name, "".join(rng.choices(string.ascii_uppercase, k=len(name))))
    return example.replace("12345", str(rng.randrange(10000, 99999)))

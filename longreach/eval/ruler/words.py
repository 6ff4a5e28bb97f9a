"""RULER's aggregation tasks: common words (``common_words_extraction.py``) and frequent words
(``freq_words_extraction.py``)."""

from __future__ import annotations

import math
import random
import string
from dataclasses import dataclass
from typing import ClassVar

from .. import haystack, string_match
from ..case import Case
from ..task_protocol import GENERATE
from .common import FIXED_SEED, case, fit, postprocess, stream_name, wonderwords

CWE_TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n{context}\n"
    "Question: What are the 10 most common words in the above list?"
)
CWE_ANSWER = " Answer: The top 10 words that appear most often in the list are:"
FWE_TEMPLATE = (
    "Read the following coded text and track the frequency of each coded word. Find the three most frequently "
    "appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots '....'. "
    "What are the three most frequently appeared words in the above coded text?"
)
FWE_ANSWER = " Answer: According to the coded text above, the three most frequently appeared words are:"


def _cwe_words() -> list[str]:
    """cwe's pool: nouns, adjectives and verbs of ``wonderwords``, sorted, shuffled with RULER's fixed seed."""
    nouns, adjectives, verbs = wonderwords()
    words = sorted(set(nouns + adjectives + verbs))
    random.Random(FIXED_SEED).shuffle(words)
    return words


@dataclass(frozen=True)
class CommonWords:
    """RULER ``cwe`` (``common_words_extraction.py``): the 10 words repeated most in a numbered list.

    One solved example first; below 4K the small configuration (example 20 words 3x/1x, list 6x/1x),
    else example 40 words 10x/3x and list 30x/3x. The example and the list's words are drawn afresh for
    every size the search probes and every back-off, as upstream's (``common_words_extraction.py:156,
    178``); packed tight, once per case, the list's words the first ``n`` of one order.
    """

    name: str = "ruler:cwe"
    kind: ClassVar[str] = GENERATE
    token_ids: ClassVar[bool] = False
    templated: ClassVar[bool] = True  # its prompt is RULER's model template around the task text
    common: int = 10
    uses_depth: bool = False
    max_new_tokens: int = 120
    metric: str = "string_match_all"
    packing: str = "ruler"

    def build(self, tokenizer, length: int, depth: float | None, seed: int) -> Case:
        small = length < 4096
        example_shape, main_repeats = ((20, 3, 1), (6, 1)) if small else ((40, 10, 3), (30, 3))
        words = _cwe_words()
        drawn, answers = {}, {}

        def draws(n: int, stream: str) -> tuple:  # the example, its answer, and the list's n words (get_example's)
            key = stream if self.packing == "ruler" else stream.rsplit("/", 1)[0]
            if key not in drawn:
                rng = random.Random(f"{stream_name(self)}/{length}/{key}")
                example = self._list(rng.sample(words, example_shape[0]), *example_shape[1:])
                drawn[key] = (
                    *example,
                    rng.sample(words, min(n, len(words)) if self.packing == "ruler" else len(words)),
                )
            example, example_answer, pool = drawn[key]
            return example, example_answer, pool[:n]

        def prompt_of(n: int, stream: str) -> str:
            example, example_answer, chosen = draws(n, stream)
            context, answers[stream] = self._list(chosen, *main_repeats)
            solved = haystack.templated(tokenizer, CWE_TEMPLATE.format(context=example), CWE_ANSWER, demonstration=True)
            solved += " " + " ".join(f"{i + 1}. {w}" for i, w in enumerate(example_answer))
            return haystack.with_bos(
                tokenizer,
                solved + "\n" + haystack.templated(tokenizer, CWE_TEMPLATE.format(context=context), CWE_ANSWER),
            )

        search = haystack.RulerSearch(10, slack=2.0, rate_at=4096, floor_then=True)  # sys_word_pair_random's
        built = fit(
            self,
            tokenizer,
            length,
            seed,
            prompt_of,
            search,
            start=max(self.common + 1, length // 16),
            least=self.common,
            most=len(words),
            unit="distinct words of wonderwords",
        )
        return case(self, length, seed, built, answers[f"{seed}/{built[0]}"])

    def _list(self, drawn: list[str], common_repeats: int, rare_repeats: int) -> tuple[str, list[str]]:
        """RULER's ``get_example`` on the drawn words: a numbered list, shuffled with the fixed seed, and its common
        words."""
        common, rare = drawn[: self.common], drawn[self.common :]
        listed = common * common_repeats + rare * rare_repeats
        random.Random(FIXED_SEED).shuffle(listed)
        return " ".join(f"{i + 1}. {w}" for i, w in enumerate(listed)), common

    def score(self, answer: str, case: Case) -> dict:
        return {"score": string_match.string_match_all(postprocess(answer), case.references)}


def zeta(alpha: float, terms: int = 10_000) -> float:
    """Riemann zeta for ``alpha > 1`` (scipy's ``zeta`` in RULER): partial sum plus Euler-Maclaurin tail."""
    head = math.fsum(k**-alpha for k in range(1, terms))
    return head + terms ** (1 - alpha) / (alpha - 1) + 0.5 * terms**-alpha + alpha * terms ** (-alpha - 1) / 12


@dataclass(frozen=True)
class FrequentWords:
    """RULER ``fwe`` (``freq_words_extraction.py``): 6-letter coded words with Zipf counts (alpha 2); the top
    one is ``...`` (noise); name the next three. Vocabulary: (length - 50) // 50 words."""

    name: str = "ruler:fwe"
    kind: ClassVar[str] = GENERATE
    token_ids: ClassVar[bool] = False
    templated: ClassVar[bool] = True  # its prompt is RULER's model template around the task text
    alpha: float = 2.0
    word_length: int = 6
    uses_depth: bool = False
    max_new_tokens: int = 50
    metric: str = "string_match_all"
    packing: str = "ruler"

    def build(self, tokenizer, length: int, depth: float | None, seed: int) -> Case:
        budget = length - self.max_new_tokens
        vocab_size = max(4, budget // 50)
        normaliser = zeta(self.alpha)
        vocabs = {}

        def vocab_of(key: str) -> list[str]:  # a case's (or the search's) coded words, the noise '...' first
            if key not in vocabs:
                rng = random.Random(f"{stream_name(self)}/{length}/{key}")
                vocab = ["".join(rng.choices(string.ascii_lowercase, k=self.word_length)) for _ in range(vocab_size)]
                while len(set(vocab)) < vocab_size:
                    vocab.append("".join(rng.choices(string.ascii_lowercase, k=self.word_length)))
                vocab = sorted(set(vocab))
                random.Random(FIXED_SEED).shuffle(vocab)
                vocab[0] = "..."  # the most frequent word is noise
                vocabs[key] = vocab
            return vocabs[key]

        def prompt_of(n: int, stream: str) -> str:
            vocab = vocab_of(stream.rsplit("/", 1)[0])
            words = [w for k, w in enumerate(vocab, start=1) for _ in range(int(n * k**-self.alpha / normaliser))]
            random.Random(FIXED_SEED).shuffle(words)
            return haystack.with_bos(
                tokenizer, haystack.templated(tokenizer, FWE_TEMPLATE.format(context=" ".join(words)), FWE_ANSWER)
            )

        step = max(1, budget // 32)  # sys_kwext: a scan from budget / 6 words, budget / 32 at a time
        built = fit(
            self,
            tokenizer,
            length,
            seed,
            prompt_of,
            haystack.RulerSearch(step, binary=False, start=budget // self.word_length),
            start=length // 3,
            unit="words",
        )
        return case(self, length, seed, built, vocab_of(str(seed))[1:4])

    def score(self, answer: str, case: Case) -> dict:
        return {"score": string_match.string_match_all(postprocess(answer), case.references)}

"""RULER's 13 synthetic tasks, generated as NVIDIA/RULER's scripts generate them.

Reproduced revision: NVIDIA/RULER ``c3f5e3b`` (2026-07-22; ``scripts/data/prepare.py``,
``scripts/data/synthetic/*.py``, ``scripts/synthetic.yaml``, ``scripts/data/synthetic/constants.py``,
``scripts/eval/``), read, not copied. Per task: the template and answer prefix inside the model
template, the tokens to generate (niah 128, vt 30, cwe 120, fwe 50, qa 32) counted in the length,
vt's in-context example (one per run, renamed per sample), cwe's solved example, QA's distractors,
needle depths drawn from ``linspace(0, 100, 40)``, scoring with ``string_match_all`` /
``string_match_part`` after RULER's post-processing.

**Packing.** ``ruler:*`` sizes its haystacks as RULER does (:class:`.haystack.RulerSearch`): one search
per task and length, then each case backs off a task's step (500 essay words, 25 noise lines, 10
documents, ...) until it fits -- so many cases end a step short of the length, as upstream's do.
``ruler-tight:*`` packs every case to the largest haystack that fits (searched per case): about 20%
longer QA prompts at 4K, and harder; not comparable with published RULER tables.

Where this differs on purpose (docs/measuring.md lists it too): every case has its own random stream
(``random.Random("<task>/<length>/<seed>/<n>")``, so cases are independent and resumable) where
RULER draws samples one after another from one seeded stream, and the size search draws its own
stream; essay sentences are split by a regular expression (RULER uses nltk's punkt, a separate
download); the length counts the BOS token (RULER counts ``tokenizer.tokenize()``, without it), so
no prompt passes the length; RULER's singular rewording of a one-value niah (``are`` -> ``is``) is
applied to the task text only, not to the whole template with its chat markup (where upstream turns
a system prompt's "You are" into "You is"); cwe cannot go past the 8,166 words of ``wonderwords``
(about 100K tokens): RULER's newer word list is not distributed on PyPI, so longer cwe cases are a
clear error; a QA case whose length needs more documents than the dataset has is an error (RULER
repeats the documents); where RULER's back-off would loop for ever, an error.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import re
import string
import uuid
from dataclasses import dataclass
from functools import lru_cache

from . import haystack, scoring
from .case import Case
from .haystack import NOISE

REVISION = "NVIDIA/RULER@c3f5e3b"
PACKINGS = ("ruler", "tight")  # ruler:* and ruler-tight:*
DEPTHS = [round(100 * i / 39) for i in range(40)]  # np.round(np.linspace(0, 100, 40)).astype(int)
FIXED_SEED = 42  # RULER shuffles needles, words and documents with random.Random(42), whatever the sample
_CONTROL = re.compile(r"[\x00-\x1f]")

NIAH_TEMPLATE = (
    "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {type_needle_v} afterwards.\n{context}\n"
    "What are all the special magic {type_needle_v} for {query} mentioned in the provided text?"
)
NIAH_ANSWER = " The special magic {type_needle_v} for {query} mentioned in the provided text are"
NIAH_NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
VT_TEMPLATE = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
               "Question: Find all variables that are assigned the value {query} in the text above.")
VT_ANSWER = (" Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
             "assigned the value {query}, they are: ")
CWE_TEMPLATE = ("Below is a numbered list of words. In these words, some appear more often than others. "
                "Memorize the ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?")
CWE_ANSWER = " Answer: The top 10 words that appear most often in the list are:"
FWE_TEMPLATE = ("Read the following coded text and track the frequency of each coded word. Find the three most frequently "
                "appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots '....'. "
                "What are the three most frequently appeared words in the above coded text?")
FWE_ANSWER = " Answer: According to the coded text above, the three most frequently appeared words are:"
QA_TEMPLATE = ("Answer the question based on the given documents. Only give me the answer and do not output any other words."
               "\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the given documents. "
               "Only give me the answer and do not output any other words.\n\nQuestion: {query}")
QA_ANSWER = " Answer:"


def postprocess(prediction: str) -> str:
    """RULER's ``postprocess_pred``: strip, control characters to newlines, strip."""
    return _CONTROL.sub("\n", prediction.strip()).strip()


@lru_cache(maxsize=1)
def _wonderwords() -> tuple[list[str], list[str], list[str]]:
    from wonderwords import random_word

    read = random_word._get_words_from_text_file
    return read("nounlist.txt"), read("adjectivelist.txt"), read("verblist.txt")


def _random(rng: random.Random, kind: str) -> str:
    """RULER's ``generate_random``: 7-digit numbers, adjective-noun words, or UUIDs.

    RULER draws a word key from the sorted list of every distinct ``adjective-noun`` (about 10M
    strings, 12 s to build); drawing the adjective and the noun on their own is the same uniform
    choice up to the few pairs that spell the same string.
    """
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "words":
        nouns, adjectives, _ = _wonderwords()
        return f"{rng.choice(adjectives)}-{rng.choice(nouns)}"
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


@lru_cache(maxsize=1)
def _essay_words() -> list[str]:
    """RULER's essay haystack unit: the essays' words, whitespace collapsed."""
    return re.sub(r"\s+", " ", haystack.essays()).split(" ")


def _insert_at_sentences(text: str, items: list[str], depths: list[float]) -> str:
    """RULER's essay insertion: ``items`` after ``int(sentences * depth / 100)`` sentences, in sorted order."""
    sents = haystack.sentences(text)
    cuts = [0] + sorted(int(len(sents) * d / 100) for d in depths) + [len(sents)]
    pieces = []
    for i in range(1, len(cuts)):
        pieces.append(" ".join(sents[cuts[i - 1] : cuts[i]]))
        if i - 1 < len(items):
            pieces.append(items[i - 1])
    return " ".join(pieces)


def _case(task, length: int, seed: int, built: tuple, references: list[str], depth: float | None = None, **extra) -> Case:
    """The case of a fitted prompt: ``built`` is ``(units, prompt, tokens)`` from :func:`_fit`."""
    n, prompt, tokens = built
    return Case(task.name, length, depth, seed, prompt, references, task.max_new_tokens, tokens, task.metric,
                haystack_units=n, **extra)


def _stream(task) -> str:
    """A task's random streams are named after ``ruler:<name>`` in either packing."""
    return "ruler:" + task.name.split(":", 1)[1] if ":" in task.name else task.name


def _fit(task, tokenizer, length: int, seed: int, prompt_of, search: haystack.RulerSearch, *, start: int, least: int = 1,
         most: int | None = None, unit: str, budget: int | None = None) -> tuple[int, str, int]:
    """The case's haystack size, prompt and tokens by the task's packing. ``prompt_of(n, stream)`` builds the
    prompt with ``n`` units from the random stream named ``stream``: ``<seed>/<n>`` for a case, ``search/<n>``
    for RULER's size search (``prompt_of`` may build the search's prompt without parts it counts apart,
    with their tokens taken off ``budget``, as vt's example)."""
    full = length - task.max_new_tokens
    what = f"{task.name} at {length} tokens"
    case = lambda n: prompt_of(n, f"{seed}/{n}")
    if task.packing == "tight":
        return haystack.fit_largest(tokenizer, full, case, start=start, least=least, most=most, what=what, unit=unit)
    if most is not None and search.rate_at is not None and search.rate_at > most:
        search = dataclasses.replace(search, rate_at=most)
    return haystack.fit_as_ruler(tokenizer, length, full, case, lambda n: prompt_of(n, f"search/{n}"), search, (task.name,),
                                 search_budget=budget, most=most, what=what, unit=unit)


@dataclass(frozen=True)
class Niah:
    """RULER's niah family (``niah.py``): needles ``One of the special magic ...`` in essays, noise or needles.

    ``grid_depth``: the one needle goes at the case's grid depth instead of a depth drawn from
    ``DEPTHS`` -- the ``niah`` heatmap task (RULER's niah_single_2 otherwise).
    """

    name: str
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
            rng = random.Random(f"{_stream(self)}/{length}/{stream}")
            user, answer, *details[stream] = self._generate(rng, n, depth)
            return haystack.with_bos(tokenizer, haystack.templated(tokenizer, user, answer))

        start = {"essay": length // 2, "noise": length // 25, "needle": length // 20}[self.haystack]
        step = 500 if self.haystack == "essay" else 5 if length < 4096 else 25  # niah.py's incremental
        built = _fit(self, tokenizer, length, seed, prompt_of, haystack.RulerSearch(step), start=start,
                     unit="essay words" if self.haystack == "essay" else f"{self.haystack} lines")
        answers, depths = details[f"{seed}/{built[0]}"]
        return _case(self, length, seed, built, answers, depth if self.grid_depth else None, needle_depths=depths)

    def _generate(self, rng: random.Random, n: int, grid_depth: float | None):
        """RULER's ``generate_input_output(n)``: (user message, answer prefix, answers, needle depths in [0, 1])."""
        num_k = max(self.num_k, self.num_q)
        keys, values, needles = [], [], []
        for _ in range(num_k):
            keys.append(_random(rng, self.type_k))
            values.append([])
            for _ in range(self.num_v):
                values[-1].append(_random(rng, self.type_v))
                needles.append(NIAH_NEEDLE.format(type_needle_v=self.type_v, key=keys[-1], value=values[-1][-1]))
        random.Random(FIXED_SEED).shuffle(needles)
        if self.haystack == "essay":
            words = _essay_words()
            text = " ".join((words * (n // len(words) + 1))[:n])
            percents = [100 * grid_depth] if self.grid_depth else rng.sample(DEPTHS, len(needles))
            context = _insert_at_sentences(text, needles, percents)
            depths = [p / 100 for p in sorted(percents)]
        else:
            if self.haystack == "noise":
                lines = [NOISE] * n
            else:
                lines = [NIAH_NEEDLE.format(type_needle_v=self.type_v, key=_random(rng, self.type_k), value=_random(rng, self.type_v))
                         for _ in range(n)]
            indexes = sorted(rng.sample(range(n), min(n, len(needles))), reverse=True)
            for index, needle in zip(indexes, needles):
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
        by_value = dict(zip((needle.rsplit(" ", 1)[-1][:-1] for needle in needles), depths))
        return (template.format(type_needle_v=type_v, context=context, query=query),
                answer.format(type_needle_v=type_v, query=query), answers, [by_value[a] for a in answers])

    def score(self, answer: str, case: Case) -> dict:
        prediction = postprocess(answer)
        return {"score": scoring.string_match_all(prediction, case.references),
                "found": scoring.needles_found(prediction, case.references)}


def _noise_with_lines(rng: random.Random, n: int, chain: list[str]) -> str:
    """vt's noise haystack: ``n`` noise lines, the chain's lines inserted in order at random lines."""
    lines = [NOISE] * n
    positions = sorted(rng.sample(range(n), min(n, len(chain))))
    for j, at in enumerate(positions):
        lines.insert(at + j, chain[j])
    return "\n".join(lines).replace(". \n", ".\n")


def _chain(rng: random.Random, hops: int, icl: bool) -> tuple[list[str], list[str]]:
    """RULER's ``generate_chains`` for one chain: names (5 letters; 3 in the example) and its lines."""
    k = 3 if icl else 5
    hops = min(10, hops) if icl else hops
    names = ["".join(rng.choices(string.ascii_uppercase, k=k)) for _ in range(hops + 1)]
    while len(set(names)) < hops + 1:  # as upstream: the chain keeps its first hops + 1 names
        names.append("".join(rng.choices(string.ascii_uppercase, k=k)))
    names = names[: hops + 1]
    value = "12345" if icl else str(rng.randrange(10000, 99999))
    return names, [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(hops)]


@dataclass(frozen=True)
class VariableTracking:
    """RULER ``vt`` (``variable_tracking.py``): one chain of 4 hops in noise, after one in-context example."""

    name: str = "ruler:vt"
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
            rng = random.Random(f"{_stream(self)}/{length}/{stream}")
            names, chain = _chain(rng, self.hops, icl=False)
            value = chain[0].split("=")[-1].strip()
            user = VT_TEMPLATE.format(context=_noise_with_lines(rng, n, chain), query=value)
            details[stream] = names
            if with_example:
                user = _randomize(example, self.hops, rng) + "\n" + user
            return haystack.with_bos(tokenizer, haystack.templated(tokenizer, user, VT_ANSWER.format(num_v=self.hops + 1, query=value)))

        # RULER's search counts the example's tokens apart, unrenamed (variable_tracking.py's example_tokens)
        search_budget = length - self.max_new_tokens - haystack.count_tokens(tokenizer, example)
        step = 5 if length < 4096 else 10
        searched = lambda n, stream: prompt_of(n, stream, with_example=not stream.startswith("search"))
        built = _fit(self, tokenizer, length, seed, searched, haystack.RulerSearch(step), start=length // 25, least=self.hops + 1,
                     unit="noise lines", budget=search_budget)
        return _case(self, length, seed, built, details[f"{seed}/{built[0]}"])

    def _example(self, tokenizer, length: int, seed: int) -> str:
        """The in-context example: a 3-letter chain valued 12345 in noise, at most 500 tokens of RULER's
        ``base`` template, followed by its answer; one per run (upstream's), one per case when packed tight."""
        names = {}

        def prompt_of(n: int, stream: str) -> str:
            rng = random.Random(f"{_stream(self)}/example/{stream}")
            names[stream], chain = _chain(rng, self.hops, icl=True)
            return VT_TEMPLATE.format(context=_noise_with_lines(rng, n, chain), query="12345") + VT_ANSWER.format(
                num_v=self.hops + 1, query="12345")

        what, least = "the vt example", self.hops + 1
        if self.packing == "tight":
            run = f"{length}/{seed}"
            n, text, _ = haystack.fit_largest(tokenizer, self.example_length, lambda n: prompt_of(n, f"{run}/{n}"), start=20,
                                              least=least, what=what, unit="noise lines")
        else:
            run = "run"
            n, text, _ = haystack.fit_as_ruler(tokenizer, self.example_length, self.example_length, lambda n: prompt_of(n, f"run/{n}"),
                                               lambda n: prompt_of(n, f"search/{n}"), haystack.RulerSearch(5), (self.name, "example"),
                                               what=what, unit="noise lines")
        return text + " " + " ".join(names[f"{run}/{n}"]) + "\n"

    def score(self, answer: str, case: Case) -> dict:
        return {"score": scoring.string_match_all(postprocess(answer), case.references)}


def _randomize(example: str, hops: int, rng: random.Random) -> str:
    """RULER's ``randomize_icl``: new names for the example's answer variables, a new value for 12345."""
    for name in example.strip().split()[-hops - 1 :]:
        example = example.replace(name, "".join(rng.choices(string.ascii_uppercase, k=len(name))))
    return example.replace("12345", str(rng.randrange(10000, 99999)))


@lru_cache(maxsize=1)
def _cwe_words() -> list[str]:
    """cwe's pool: nouns, adjectives and verbs of ``wonderwords``, sorted, shuffled with RULER's fixed seed."""
    nouns, adjectives, verbs = _wonderwords()
    words = sorted(set(nouns + adjectives + verbs))
    random.Random(FIXED_SEED).shuffle(words)
    return words


@dataclass(frozen=True)
class CommonWords:
    """RULER ``cwe`` (``common_words_extraction.py``): the 10 words repeated most in a numbered list.

    One solved example first; below 4K the small configuration (example 20 words 3x/1x, list 6x/1x),
    else example 40 words 10x/3x and list 30x/3x.
    """

    name: str = "ruler:cwe"
    common: int = 10
    uses_depth: bool = False
    max_new_tokens: int = 120
    metric: str = "string_match_all"
    packing: str = "ruler"

    def build(self, tokenizer, length: int, depth: float | None, seed: int) -> Case:
        small = length < 4096
        example_shape, main_repeats = ((20, 3, 1), (6, 1)) if small else ((40, 10, 3), (30, 3))
        words = _cwe_words()
        drawn = {}

        def draws(key: str) -> tuple:  # a case's (or the search's) example, its answer, and its pool of words
            if key not in drawn:
                rng = random.Random(f"{_stream(self)}/{length}/{key}")
                example = self._list(rng.sample(words, example_shape[0]), *example_shape[1:])
                drawn[key] = (*example, rng.sample(words, len(words)))  # a pool's first n words: RULER's random.sample(words, n)
            return drawn[key]

        def prompt_of(n: int, stream: str) -> str:
            example, example_answer, pool = draws(stream.rsplit("/", 1)[0])
            context, _ = self._list(pool[:n], *main_repeats)
            solved = haystack.templated(tokenizer, CWE_TEMPLATE.format(context=example), CWE_ANSWER)
            solved += " " + " ".join(f"{i + 1}. {w}" for i, w in enumerate(example_answer))
            return haystack.with_bos(tokenizer, solved + "\n" + haystack.templated(tokenizer, CWE_TEMPLATE.format(context=context), CWE_ANSWER))

        search = haystack.RulerSearch(10, slack=2.0, rate_at=4096, floor_then=True)  # sys_word_pair_random's
        built = _fit(self, tokenizer, length, seed, prompt_of, search, start=max(self.common + 1, length // 16), least=self.common,
                     most=len(words), unit="distinct words of wonderwords")
        return _case(self, length, seed, built, draws(str(seed))[2][: self.common])

    def _list(self, drawn: list[str], common_repeats: int, rare_repeats: int) -> tuple[str, list[str]]:
        """RULER's ``get_example`` on the drawn words: a numbered list, shuffled with the fixed seed, and its common words."""
        common, rare = drawn[: self.common], drawn[self.common :]
        listed = common * common_repeats + rare * rare_repeats
        random.Random(FIXED_SEED).shuffle(listed)
        return " ".join(f"{i + 1}. {w}" for i, w in enumerate(listed)), common

    def score(self, answer: str, case: Case) -> dict:
        return {"score": scoring.string_match_all(postprocess(answer), case.references)}


def zeta(alpha: float, terms: int = 10_000) -> float:
    """Riemann zeta for ``alpha > 1`` (scipy's ``zeta`` in RULER): partial sum plus Euler-Maclaurin tail."""
    head = math.fsum(k**-alpha for k in range(1, terms))
    return head + terms ** (1 - alpha) / (alpha - 1) + 0.5 * terms**-alpha + alpha * terms ** (-alpha - 1) / 12


@dataclass(frozen=True)
class FrequentWords:
    """RULER ``fwe`` (``freq_words_extraction.py``): 6-letter coded words with Zipf counts (alpha 2); the top
    one is ``...`` (noise); name the next three. Vocabulary: (length - 50) // 50 words."""

    name: str = "ruler:fwe"
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
                rng = random.Random(f"{_stream(self)}/{length}/{key}")
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
            return haystack.with_bos(tokenizer, haystack.templated(tokenizer, FWE_TEMPLATE.format(context=" ".join(words)), FWE_ANSWER))

        step = max(1, budget // 32)  # sys_kwext: a scan from budget / 6 words, budget / 32 at a time
        built = _fit(self, tokenizer, length, seed, prompt_of, haystack.RulerSearch(step, binary=False, start=budget // self.word_length),
                     start=length // 3, unit="words")
        return _case(self, length, seed, built, vocab_of(str(seed))[1:4])

    def score(self, answer: str, case: Case) -> dict:
        return {"score": scoring.string_match_all(postprocess(answer), case.references)}


@dataclass(frozen=True)
class QA:
    """RULER ``qa_1`` (SQuAD v2 dev) / ``qa_2`` (HotpotQA dev, distractor setting), ``qa.py``.

    Case ``i`` asks question ``i`` of the dataset, as RULER's sample ``i`` does. Its gold documents
    come first -- for HotpotQA all 10 paragraphs of the question; for SQuAD the paragraph, then the
    other paragraphs of its article -- then random documents of the rest, shuffled together.
    """

    name: str
    dataset: str
    uses_depth: bool = False
    max_new_tokens: int = 32
    metric: str = "string_match_part"
    packing: str = "ruler"

    def build(self, tokenizer, length: int, depth: float | None, seed: int) -> Case:
        questions, documents = qa_data(self.dataset)
        if seed >= len(questions):
            raise ValueError(f"{self.name}: sample {seed} is out of range: the {self.dataset} set has {len(questions)} questions")
        orders = {}

        def order_of(key: str) -> tuple[dict, list[int]]:  # RULER searches on question 0, a case asks question `seed`
            if key not in orders:
                item = questions[0 if key == "search" else seed]
                others = sorted(set(range(len(documents))) - set(item["documents"] + item["article"]))
                rng = random.Random(f"{_stream(self)}/{length}/{key}")
                article = rng.sample(item["article"], len(item["article"]))
                orders[key] = item, item["documents"] + article + rng.sample(others, len(others))  # a prefix: RULER's choice
            return orders[key]

        def prompt_of(n: int, stream: str) -> str:
            item, order = order_of(stream.rsplit("/", 1)[0])
            chosen = [documents[i] for i in order[: max(n, len(item["documents"]))]]
            random.Random(FIXED_SEED).shuffle(chosen)
            context = "\n\n".join(f"Document {i + 1}:\n{d}" for i, d in enumerate(chosen))
            return haystack.with_bos(tokenizer, haystack.templated(tokenizer, QA_TEMPLATE.format(context=context, query=item["question"]), QA_ANSWER))

        built = _fit(self, tokenizer, length, seed, prompt_of, haystack.RulerSearch(10), start=max(len(questions[seed]["documents"]), length // 200),
                     most=len(documents), unit=f"{self.dataset} documents")
        return _case(self, length, seed, built, questions[seed]["answers"])

    def score(self, answer: str, case: Case) -> dict:
        return {"score": scoring.string_match_part(postprocess(answer), case.references)}


@lru_cache(maxsize=2)
def qa_data(dataset: str) -> tuple[list[dict], list[str]]:
    """RULER's ``read_squad`` / ``read_hotpotqa``: questions (gold document indices, same-article
    paragraphs, answers) and the sorted pool of distinct documents."""
    raw = json.loads((haystack.ruler_data_folder() / f"{dataset}.json").read_text(encoding="utf-8"))
    if dataset == "squad":
        documents = sorted({p["context"] for d in raw["data"] for p in d["paragraphs"]})
        index = {c: i for i, c in enumerate(documents)}
        questions = []
        for article in raw["data"]:
            paragraphs = [index[p["context"]] for p in article["paragraphs"]]
            for p in article["paragraphs"]:
                gold = index[p["context"]]
                questions += [{"question": qa["question"], "answers": [a["text"] for a in qa["answers"]], "documents": [gold],
                               "article": [i for i in paragraphs if i != gold]}
                              for qa in p["qas"] if not qa["is_impossible"]]
        return questions, documents
    text = lambda title, sentences: f"{title}\n{''.join(sentences)}"
    documents = sorted({text(t, s) for item in raw for t, s in item["context"]})
    index = {c: i for i, c in enumerate(documents)}
    questions = [{"question": item["question"], "answers": [item["answer"]], "article": [],
                  "documents": [index[text(t, s)] for t, s in item["context"]]} for item in raw]
    return questions, documents


def qa_available() -> str | None:
    """``None`` when RULER's data is installed, else the one-line reason QA tasks are left out."""
    try:
        haystack.ruler_data_folder()
    except RuntimeError:
        return f"qa_1/qa_2 left out: RULER's QA data is not installed ({haystack.RULER_DATA_INSTALL})"
    return None


TASKS = {
    "niah_single_1": Niah("ruler:niah_single_1", haystack="noise"),
    "niah_single_2": Niah("ruler:niah_single_2"),
    "niah_single_3": Niah("ruler:niah_single_3", type_v="uuids"),
    "niah_multikey_1": Niah("ruler:niah_multikey_1", num_k=4),
    "niah_multikey_2": Niah("ruler:niah_multikey_2", haystack="needle"),
    "niah_multikey_3": Niah("ruler:niah_multikey_3", haystack="needle", type_k="uuids", type_v="uuids"),
    "niah_multivalue": Niah("ruler:niah_multivalue", num_v=4),
    "niah_multiquery": Niah("ruler:niah_multiquery", num_q=4),
    "vt": VariableTracking(),
    "cwe": CommonWords(),
    "fwe": FrequentWords(),
    "qa_1": QA("ruler:qa_1", "squad"),
    "qa_2": QA("ruler:qa_2", "hotpotqa"),
}
TIGHT = {name: dataclasses.replace(task, name=task.name.replace("ruler:", "ruler-tight:"), packing="tight") for name, task in TASKS.items()}
"""The same tasks packed tight (``ruler-tight:*``): each case's haystack as large as fits."""

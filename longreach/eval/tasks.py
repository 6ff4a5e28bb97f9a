"""Tasks: a deterministic case generator (task, length, depth, seed -> prompt) plus its scoring rule.

* ``niah4`` / ``niah4-chat`` -- the STRING paper's 4-needle test as HKUNLP/STRING runs it;
* ``passkey`` / ``passkey-chat`` -- passkey retrieval as landmark attention's script runs it (the
  prompt LongLM and ChunkLlama reuse);
* ``ruler:<name>`` -- RULER's 13 tasks (:mod:`.ruler`), sized as RULER sizes them; ``ruler`` names them
  all; ``ruler-tight:<name>`` / ``ruler-tight`` pack each case to the largest haystack that fits;
* ``infbench:<name>`` / ``infbench-qwen2:<name>`` -- InfiniteBench's 12 tasks as STRING's script runs them
  (:mod:`.infbench`), with its Llama 3.1 or Qwen2 prompts; ``infbench`` names the nine of the STRING paper's table;
* ``niah`` -- RULER's niah_single_2 with the needle at each grid depth (the depth x length heatmap);
* ``ppl`` -- perplexity by position (:mod:`.perplexity`);
* tasks other packages define and :func:`register` here: ``probe`` / ``probe-tail``, retrieval on a checkpoint of
  ``longreach probe train`` (:mod:`longreach.probe.task`, registered when imported: the command line imports it).

``raw`` tasks are plain text as the papers ran base models; ``-chat`` ones put the same request in
the model's chat template. Every prompt plus the tokens to generate fits the length, counted with
the model's own tokenizer.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import re
from dataclasses import dataclass
from typing import ClassVar

from . import haystack, infbench, ruler, string_match
from .case import Case
from .task_protocol import GENERATE, AnyTask

STRING_REVISION = "HKUNLP/STRING@216cc2f niah/test_niah_llama.py"
PASSKEY_REVISION = "epfml/landmark-attention@d963e50 llama/run_test.py"


# niah4's question forms: what follows the question in the raw prompt, and the answer prefix (STRING's get_needles)
NIAH4_QUESTIONS = {"standard": ("\n", "The numbers are"), "llama3.1": ("\n ", "")}


@dataclass(frozen=True)
class StringNeedles:
    """The STRING paper's 4-needle test (HKUNLP/STRING ``niah/test_niah_llama.py``).

    Four keyless needles `` One of the magic number is: X. `` with 6-digit values
    (``randint(100000, 1000000)``), one per quarter (``segment = 0.99 / 4``, uniform within), in
    essay sentences split at ``.`` from STRING's own ``PaulGrahamEssays.json`` (its order of the essays,
    :func:`.haystack.string_essays`); the task text first, the question last; 128 tokens to generate,
    held back from the length; a case passes when at least 2 of the 4 values come back.

    The question ends ``\nThe numbers are``, or, for Llama 3.1, ``\n `` with no answer prefix: STRING's
    ``get_needles`` asks so when the model's path holds ``llama3.1`` (lines 56-62), as its published Llama 3.1
    runs are named. ``niah4:question=llama3.1`` and ``niah4:question=standard`` choose the form;
    :func:`for_model` chooses it for a plain ``niah4`` from the model's name.

    Differences, on purpose: the values are drawn per case (upstream draws one set for all 500
    tests); the haystack stops at the last sentence that fits (upstream adds one more, so its
    prompts overshoot ``L - 128`` by up to a sentence).
    """

    name: str
    kind: ClassVar[str] = GENERATE
    token_ids: ClassVar[bool] = False
    chat: bool = False
    needles: int = 4
    needed: int = 2
    uses_depth: bool = False
    max_new_tokens: int = 128
    metric: str = "at_least_2_of_4"
    description: str = (
        "There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
        "I will quiz you about the important information there.\n"
    )
    question: str = "\n\nWhat are the magic numbers mentioned in the provided text?"
    question_form: str = "standard"  # a key of NIAH4_QUESTIONS

    def build(self, tokenizer, length: int, depth: float | None, seed: int) -> Case:
        rng = random.Random(f"{self.name.split(':')[0]}/{length}/{seed}")  # both question forms: the same draws
        segment = 0.99 / self.needles
        depths = [j * segment + rng.uniform(0, segment) for j in range(self.needles)]
        values = [str(rng.randint(100000, 1000000)) for _ in range(self.needles)]
        needles = [f" One of the magic number is: {v}. " for v in values]
        step = 50 if length - self.max_new_tokens > 64000 else 1  # upstream's chunk of sentences past 64K
        pieces = haystack.string_essays().split(".")  # STRING's own essay file, in its order
        chunks = [".".join(pieces[i : i + step]) for i in range(0, len(pieces), step)]

        def build(n: int) -> str:
            places = [0] + [int(d * n) for d in depths]
            context = "".join(
                ".".join(chunks[a:b]) + ". " + needle
                for (a, b), needle in zip(itertools.pairwise(places), needles, strict=True)
            )
            context += ". ".join(chunks[places[-1] : n]) + ". \n"
            context = context[1:] if context.startswith(".") else context
            line_end, answer_prefix = NIAH4_QUESTIONS[self.question_form]
            if self.chat:
                return haystack.with_bos(
                    tokenizer,
                    haystack.templated(tokenizer, self.description + context + self.question, answer_prefix),
                )
            return haystack.with_bos(tokenizer, self.description + context + self.question + line_end + answer_prefix)

        built = haystack.fit_largest(
            tokenizer,
            length - self.max_new_tokens,
            build,
            start=length // 30,
            most=len(chunks),
            what=f"{self.name} at {length} tokens",
            unit="essay sentences",
        )
        return Case(
            self.name,
            length,
            None,
            seed,
            built[1],
            values,
            self.max_new_tokens,
            built[2],
            self.metric,
            needle_depths=depths,
            haystack_units=built[0],
        )

    @property
    def templated(self) -> bool:
        """Whether the prompt is the model template around the task text (the ``-chat`` form)."""
        return self.chat

    def score(self, answer: str, case: Case) -> dict:
        found = string_match.needles_found(" ".join(answer.split()), case.references)
        return {"score": 100.0 * (sum(found) >= self.needed), "found": found, "fraction": sum(found) / len(found)}


@dataclass(frozen=True)
class Passkey:
    """Passkey retrieval (Mohtashami & Jaggi 2023), landmark attention's ``generate_prompt``.

    Lines joined by newlines: the task text, ``n`` characters of noise cut at a random point
    (``randint(0, n)``), the pass key line, the rest of the noise, ``What is the pass key? The pass key
    is``; the key is ``randint(1, 50000)``; 10 tokens to generate; a case passes when the first integer
    of the answer is the key. ``n`` is the most characters that fit the length (upstream lists ``n``
    by hand and caps it at 2,000 noise repeats).
    """

    name: str
    kind: ClassVar[str] = GENERATE
    token_ids: ClassVar[bool] = False
    chat: bool = False
    uses_depth: bool = False
    max_new_tokens: int = 10
    metric: str = "first_integer"
    description: str = (
        "There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
        "I will quiz you about the important information there."
    )

    def build(self, tokenizer, length: int, depth: float | None, seed: int) -> Case:
        noise = " ".join([haystack.NOISE] * (length + 100))  # more characters than `length` tokens can hold
        details = {}

        def build(n: int) -> str:
            rng = random.Random(f"{self.name}/{length}/{seed}/{n}")
            prefix = rng.randint(0, n)
            key = rng.randint(1, 50000)
            details[n] = key, prefix / n
            lines = [
                self.description,
                noise[:prefix],
                f"The pass key is {key}. Remember it. {key} is the pass key.",
                noise[: n - prefix],
            ]
            if self.chat:
                return haystack.with_bos(
                    tokenizer,
                    haystack.templated(tokenizer, "\n".join(lines + ["What is the pass key?"]), "The pass key is"),
                )
            return haystack.with_bos(tokenizer, "\n".join(lines + ["What is the pass key? The pass key is"]))

        n, prompt, tokens = haystack.fit_largest(
            tokenizer,
            length - self.max_new_tokens,
            build,
            start=3 * length,
            most=len(noise),
            what=f"{self.name} at {length} tokens",
            unit="noise characters",
        )
        key, where = details[n]
        return Case(
            self.name,
            length,
            None,
            seed,
            prompt,
            [str(key)],
            self.max_new_tokens,
            tokens,
            self.metric,
            needle_depths=[where],
            haystack_units=n,
        )

    @property
    def templated(self) -> bool:
        """Whether the prompt is the model template around the task text (the ``-chat`` form)."""
        return self.chat

    def score(self, answer: str, case: Case) -> dict:
        number = re.search(r"\d+", answer)
        found = number is not None and int(number.group()) == int(case.references[0])
        return {"score": 100.0 * found, "found": [found]}


TASKS = {
    "niah4": StringNeedles("niah4"),
    "niah4-chat": StringNeedles("niah4-chat", chat=True),
    "passkey": Passkey("passkey"),
    "passkey-chat": Passkey("passkey-chat", chat=True),
    "niah": ruler.Niah("niah", grid_depth=True, packing="tight"),
    **{f"ruler:{name}": task for name, task in ruler.TASKS.items()},
    **{f"ruler-tight:{name}": task for name, task in ruler.TIGHT.items()},
    **infbench.TASKS,
}
FAMILIES = ("ruler", "ruler-tight", *infbench.FAMILIES)  # names that stand for a benchmark's tasks
REVISIONS = {
    "niah4": STRING_REVISION,
    "passkey": PASSKEY_REVISION,
    "ruler": ruler.REVISION,
    "niah": ruler.REVISION,
    "infbench": infbench.REVISION,
}
qa_available = ruler.qa_available


def data_problem(name: str) -> str | None:
    """Why task ``name`` cannot build its cases here, in one line, or ``None``: its dataset is missing (where to get
    it), or a record is not in upstream's format (the file, the line and what is wrong). Checked before a run
    starts."""
    task = TASKS.get(name)
    if isinstance(task, infbench.InfiniteBenchTask) and not task.synthetic:
        try:
            infbench.data.records(task.task)
        except (OSError, ValueError) as error:  # missing, unreadable, or not upstream's format
            return str(error)
    return None


def revision(task: str) -> str:
    """The upstream code a task reproduces (``ppl`` reproduces none)."""
    return REVISIONS.get(re.split(r"[:-]", task)[0], "")


REGISTERED: dict[str, AnyTask] = {}  # tasks defined outside this package, by name (register puts them here)
GROUPS: dict[str, str] = {}  # each registered group's names ("probe and probe-tail") -> what it is, for the error


def register(group: dict[str, AnyTask], what: str) -> None:
    """Make ``group``'s tasks (name -> task) known by name; ``what`` says what they are, in the list of tasks an
    unknown name gets. The package that defines them calls it (:mod:`longreach.probe.task` does, when imported)."""
    REGISTERED.update(group)
    GROUPS[" and ".join(group)] = what


def token_id_tasks() -> list[str]:
    """The registered tasks whose prompts are token ids (the tasks of a model without a tokenizer)."""
    return [name for name, task in REGISTERED.items() if task.token_ids]


def get(name: str) -> AnyTask:
    if name == "ppl":
        from .perplexity import Perplexity

        return Perplexity()
    if name in REGISTERED:
        return REGISTERED[name]
    base, option = name.split(":", 1) if ":" in name else (name, "")
    if base in ("niah4", "niah4-chat") and option:
        form = option.removeprefix("question=")
        if not option.startswith("question=") or form not in NIAH4_QUESTIONS:
            raise ValueError(f"task {name!r}: niah4 takes question=standard or question=llama3.1")
        return dataclasses.replace(TASKS[base], name=name, question_form=form)
    if name not in TASKS:
        shown = [n for n in TASKS if not n.startswith(("ruler-tight:", "infbench-qwen2:"))]
        groups = "".join(f", {names} ({what})" for names, what in GROUPS.items())
        raise ValueError(
            f"unknown task {name!r}; available: {', '.join(shown)}, ruler (all RULER tasks), "
            f"ruler-tight:<name> and ruler-tight (packed tight), infbench (the STRING paper's nine), "
            f"infbench-qwen2:<name> and infbench-qwen2 (Qwen2's prompts), ppl{groups}"
        )
    return TASKS[name]


def is_llama_3_1(model: str) -> bool:
    """Whether STRING's niah4 asks ``model`` its Llama 3.1 question: its path holds ``llama3.1`` (upstream's key),
    read without case, hyphens or underscores, so that ``meta-llama/Llama-3.1-8B-Instruct`` counts."""
    return "llama3.1" in re.sub(r"[-_ ]", "", model.lower())


def for_model(names: list[str], model: str) -> list[str]:
    """``names`` with a plain ``niah4`` (``niah4-chat``) given the question form STRING asks ``model``."""
    if not is_llama_3_1(model):
        return names
    return [f"{n}:question=llama3.1" if n in ("niah4", "niah4-chat") else n for n in names]


def expand(name: str) -> list[str]:
    """``ruler`` (``ruler-tight``) means every RULER task of that packing (the two QA tasks only when RULER's
    data is installed); ``infbench`` (``infbench-qwen2``) the nine tasks of the STRING paper's table."""
    if name not in FAMILIES:
        get(name)
        return [name]
    if name in infbench.FAMILIES:
        return [f"{name}:{n}" for n in infbench.PAPER]
    names = [f"{name}:{n}" for n in ruler.TASKS]
    return names if qa_available() is None else [n for n in names if ":qa_" not in n]

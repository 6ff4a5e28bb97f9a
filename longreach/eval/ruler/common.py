"""What RULER's task generators share: the revision, depths and fixed seed, post-processing, random keys and
words, the essay haystack, and fitting a case to its length by the task's packing."""

from __future__ import annotations

import dataclasses
import random
import re
import uuid
from functools import lru_cache

from .. import haystack
from ..case import Case

REVISION = "NVIDIA/RULER@c3f5e3b"
PACKINGS = ("ruler", "tight")  # ruler:* and ruler-tight:*
DEPTHS = [round(100 * i / 39) for i in range(40)]  # np.round(np.linspace(0, 100, 40)).astype(int)
FIXED_SEED = 42  # RULER shuffles needles, words and documents with random.Random(42), whatever the sample
CONTROL = re.compile(r"[\x00-\x1f]")


def postprocess(prediction: str) -> str:
    """RULER's ``postprocess_pred``: strip, control characters to newlines, strip."""
    return CONTROL.sub("\n", prediction.strip()).strip()


@lru_cache(maxsize=1)
def wonderwords() -> tuple[list[str], list[str], list[str]]:
    from wonderwords import random_word

    read = random_word._get_words_from_text_file
    return read("nounlist.txt"), read("adjectivelist.txt"), read("verblist.txt")


def random_value(rng: random.Random, kind: str) -> str:
    """RULER's ``generate_random``: 7-digit numbers, adjective-noun words, or UUIDs.

    RULER draws a word key from the sorted list of every distinct ``adjective-noun`` (wonderwords 3.0.1's
    6,185,184 pairs spell 6,171,620 strings; 12 s to build); drawing the adjective and the noun on their own
    chooses among the pairs instead, so that each of the 13,564 strings two pairs spell is drawn twice as often
    as the others (a stated difference).
    """
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "words":
        nouns, adjectives, _ = wonderwords()
        return f"{rng.choice(adjectives)}-{rng.choice(nouns)}"
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


@lru_cache(maxsize=1)
def essay_words() -> list[str]:
    """RULER's essay haystack unit: the essays' words, whitespace collapsed (``niah.py:87``)."""
    return re.sub(r"\s+", " ", haystack.essays()).split(" ")


@lru_cache(maxsize=16)
def essay_sentences(n: int) -> tuple[str, ...]:
    """The sentences of RULER's essay haystack of ``n`` words (``niah.py:148-155``): the first ``n`` words, the
    essays repeated as often as needed, joined by spaces and split by :func:`.haystack.sentences`. Cached: every
    case of a task and length starts from the size its search found."""
    words = essay_words()
    return tuple(haystack.sentences(" ".join((words * (n // len(words) + 1))[:n])))


def insertion_index(sentences: int, depth: float) -> int:
    """The sentences before a needle at ``depth`` percent: RULER's ``int(len(document_sents) * (depth / 100))``
    (``niah.py:157``), evaluated in that order. ``int(sentences * depth / 100)`` rounds differently at some pairs
    (150 sentences at depth 82: 122 against 123)."""
    return int(sentences * (depth / 100))


def insert_at_sentences(sents: tuple[str, ...], items: list[str], depths: list[float]) -> str:
    """RULER's essay insertion (``niah.py:156-166``): ``items`` after :func:`insertion_index` sentences each, in
    sorted order, every piece joined by spaces."""
    cuts = [0] + sorted(insertion_index(len(sents), d) for d in depths) + [len(sents)]
    pieces = []
    for i in range(1, len(cuts)):
        pieces.append(" ".join(sents[cuts[i - 1] : cuts[i]]))
        if i - 1 < len(items):
            pieces.append(items[i - 1])
    return " ".join(pieces)


def case(
    task, length: int, seed: int, built: tuple, references: list[str], depth: float | None = None, **extra
) -> Case:
    """The case of a fitted prompt: ``built`` is ``(units, prompt, tokens, searched size)`` from :func:`fit`."""
    n, prompt, tokens, searched = built
    return Case(
        task.name,
        length,
        depth,
        seed,
        prompt,
        references,
        task.max_new_tokens,
        tokens,
        task.metric,
        haystack_units=n,
        searched_units=searched,
        **extra,
    )


def stream_name(task) -> str:
    """A task's random streams are named after ``ruler:<name>`` in either packing."""
    return "ruler:" + task.name.split(":", 1)[1] if ":" in task.name else task.name


def fit(
    task,
    tokenizer,
    length: int,
    seed: int,
    prompt_of,
    search: haystack.RulerSearch,
    *,
    start: int,
    least: int = 1,
    most: int | None = None,
    unit: str,
    budget: int | None = None,
) -> tuple[int, str, int, int | None]:
    """The case's haystack size, prompt and tokens by the task's packing, and the size RULER's search found for
    the task and length (``None`` packed tight: each case is searched on its own). ``prompt_of(n, stream)`` builds the
    prompt with ``n`` units from the random stream named ``stream``: ``<seed>/<n>`` for a case, ``search/<n>``
    for RULER's size search (``prompt_of`` may build the search's prompt without parts it counts apart,
    with their tokens taken off ``budget``, as vt's example)."""
    full = length - task.max_new_tokens
    what = f"{task.name} at {length} tokens"

    def case(n):
        return prompt_of(n, f"{seed}/{n}")

    if task.packing == "tight":
        return *haystack.fit_largest(
            tokenizer, full, case, start=start, least=least, most=most, what=what, unit=unit
        ), None
    if most is not None and search.rate_at is not None and search.rate_at > most:
        search = dataclasses.replace(search, rate_at=most)
    return haystack.fit_as_ruler(
        tokenizer,
        length,
        full,
        case,
        lambda n: prompt_of(n, f"search/{n}"),
        search,
        (task.name,),
        search_budget=budget,
        least=least,
        most=most,
        what=what,
        unit=unit,
    )

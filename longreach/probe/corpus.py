"""A synthetic corpus whose retrieval distances follow a document-length distribution (STRING paper, section 3).

The paper's probing experiment pretrains RoPE models and finds that effective length follows the position
frequency ``f(i)`` of the training data. Here the skill a probe tests is in the documents themselves: a
document is filler tokens with key-value records ``KEY k VAL v1 v2`` and, later in the same document,
queries ``ASK k VAL v1 v2`` for some of them. A query can only be answered by attending back to its record,
so the distances a model learns to retrieve over are those between records and queries *inside a document*:
long distances occur only in long documents, exactly as ``f(i)`` counts them. The loss is on the answers
(``v1 v2`` after ``ASK k VAL``) only; the filler is noise no model can predict.

Document lengths, in tokens, come from one of three distributions over a window ``L``:

* ``natural``: log-normal (as web text: most documents short, a few long), truncated at ``L``; one
  document per training row;
* ``uniform``: uniform on ``[MIN_DOCUMENT, L]``; one document per row;
* ``concat``: natural lengths, documents packed one after another to fill each row (attention crosses
  documents, as in packed pretraining; records and queries stay inside their document).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

PAD, BOS, KEY, VAL, ASK = range(5)
SPECIAL = 5
FILLER = 32  # filler tokens: noise between records
SYMBOLS = 96  # keys and values are drawn from these
VOCAB = SPECIAL + FILLER + SYMBOLS
RECORD = 5  # KEY k VAL v1 v2 (a query: ASK k VAL v1 v2)
MIN_DOCUMENT = 4 * RECORD
EVERY = 24  # one record (and its query) per this many tokens of document, on average
DISTRIBUTIONS = ("natural", "uniform", "concat")
IGNORE = -100  # label of tokens without a loss


@dataclass(frozen=True)
class Corpus:
    """Training rows of ``window`` tokens whose documents follow ``distribution``.

    ``median``: the log-normal's median as a fraction of the window (``natural`` and ``concat``), ``sigma``
    its spread in log space.
    """

    window: int
    distribution: str = "natural"
    median: float = 0.25
    sigma: float = 1.0

    def __post_init__(self) -> None:
        if self.distribution not in DISTRIBUTIONS:
            raise ValueError(f"distribution={self.distribution!r} is not one of: {', '.join(DISTRIBUTIONS)}")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 4 * MIN_DOCUMENT:
            raise ValueError(f"window={self.window!r} is out of range: an integer >= {4 * MIN_DOCUMENT}")
        if not (0 < self.median <= 1) or not (0 < self.sigma <= 4):
            raise ValueError(f"median={self.median} and sigma={self.sigma} are out of range: 0 < median <= 1, 0 < sigma <= 4")

    def lengths(self, count: int, rng: np.random.Generator) -> np.ndarray:
        """``count`` document lengths in ``[MIN_DOCUMENT, window]``."""
        if self.distribution == "uniform":
            return rng.integers(MIN_DOCUMENT, self.window + 1, size=count)
        drawn = rng.lognormal(np.log(self.median * self.window), self.sigma, size=count)
        return np.clip(np.round(drawn), MIN_DOCUMENT, self.window).astype(np.int64)

    def batch(self, rows: int, rng: np.random.Generator) -> dict[str, torch.Tensor]:
        """``rows`` training rows: ``input_ids``, ``labels`` (answers only) and ``attention_mask`` (padding
        at the end of a row), ``[rows, window]`` each, and ``lengths``: every document's length."""
        ids = np.full((rows, self.window), PAD, dtype=np.int64)
        labels = np.full((rows, self.window), IGNORE, dtype=np.int64)
        used = []
        for row in range(rows):
            start = 0
            while start < self.window - MIN_DOCUMENT:
                length = min(int(self.lengths(1, rng)[0]), self.window - start)
                tokens, answers = document(length, rng)
                ids[row, start : start + length], labels[row, start : start + length] = tokens, answers
                used.append(length)
                start += length
                if self.distribution != "concat":
                    break
        return {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels),
                "attention_mask": torch.from_numpy(ids != PAD).long(), "lengths": torch.tensor(used)}


def document(length: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """One document of ``length`` tokens: BOS, filler, records, and a query after each record it asks about.

    Returns the tokens and their labels (the answers ``v1 v2`` of each query; ``IGNORE`` elsewhere). A record and
    its query are placed independently, uniformly over the document (the query after the record), so the
    distance between them ranges over the whole document.
    """
    tokens = rng.integers(SPECIAL, SPECIAL + FILLER, size=length)
    tokens[0] = BOS  # every document starts with one, as in packed pretraining
    labels = np.full(length, IGNORE, dtype=np.int64)
    slots = (length - 1) // RECORD  # records and queries sit on slots after BOS, never overlapping
    pairs = min(max(1, length // EVERY), slots // 2, SYMBOLS)
    chosen = np.sort(rng.choice(slots, size=2 * pairs, replace=False))
    keys = rng.choice(SYMBOLS, size=pairs, replace=False) + SPECIAL + FILLER
    values = rng.integers(SPECIAL + FILLER, VOCAB, size=(pairs, 2))
    order = rng.permutation(2 * pairs)  # which slots hold records and which queries: each query after its record
    record_slots, query_slots = _pair_up(chosen[order], pairs)
    for key, value, record, query in zip(keys, values, record_slots, query_slots):
        record, query = 1 + record * RECORD, 1 + query * RECORD
        tokens[record : record + RECORD] = (KEY, key, VAL, *value)
        tokens[query : query + RECORD] = (ASK, key, VAL, *value)
        labels[query + 3 : query + 5] = value
    return tokens, labels


def _pair_up(slots: np.ndarray, pairs: int) -> tuple[list[int], list[int]]:
    """Split ``2 * pairs`` distinct slots into (record, query) pairs with the record first in each."""
    firsts, seconds = slots[:pairs], slots[pairs:]
    return [int(min(a, b)) for a, b in zip(firsts, seconds)], [int(max(a, b)) for a, b in zip(firsts, seconds)]


def retrieval_case(window: int, distance: int, needles: int, rng: np.random.Generator) -> tuple[np.ndarray, int, np.ndarray]:
    """A probe of ``window`` tokens: filler, ``needles`` records with distinct keys, and at the end a query for
    the one whose record starts ``distance`` tokens before the query; the others sit at random places.

    Returns ``(tokens, position, answer)``: the query's answer ``v1 v2`` is predicted at ``position`` and
    ``position + 1`` (the logits of the tokens before them).
    """
    query = window - RECORD
    target = query - distance
    if not (1 <= target and distance >= RECORD):
        raise ValueError(f"distance={distance} is out of range: {RECORD} .. {query - 1} for a window of {window}")
    tokens = rng.integers(SPECIAL, SPECIAL + FILLER, size=window)
    tokens[0] = BOS
    keys = rng.choice(SYMBOLS, size=needles, replace=False) + SPECIAL + FILLER
    values = rng.integers(SPECIAL + FILLER, VOCAB, size=(needles, 2))
    taken = [(target, target + RECORD), (query, window)]
    for key, value, index in zip(keys, values, range(needles)):
        start = target if index == 0 else _free_start(taken, 1, query - RECORD, rng)
        if index:
            taken.append((start, start + RECORD))
        tokens[start : start + RECORD] = (KEY, key, VAL, *value)
    tokens[query : query + RECORD] = (ASK, keys[0], VAL, *values[0])
    return tokens, query + 2, values[0]


def _free_start(taken: list[tuple[int, int]], low: int, high: int, rng: np.random.Generator) -> int:
    """A start in ``[low, high]`` whose record overlaps none of ``taken``."""
    for _ in range(1000):
        start = int(rng.integers(low, high + 1))
        if all(start + RECORD <= a or start >= b for a, b in taken):
            return start
    raise ValueError("no room for another record: use fewer needles or a longer window")

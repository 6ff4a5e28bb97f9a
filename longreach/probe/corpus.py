"""A synthetic corpus whose retrieval distances follow a document-length distribution (STRING paper, section 3).

The paper's probing experiment pretrains RoPE models and finds that effective length follows the position
frequency ``f(i)`` of the training data. Here the skill a probe tests is in the documents themselves: a
document is filler tokens with key-value records ``KEY r`` (``r``: one token that holds a key and its value)
and, later in the same document, queries ``ASK k v`` for some of them. A query can only be answered by
attending back to its record, so the distances a model learns to retrieve over are those between records and
queries *inside a document*: long distances occur only in long documents, exactly as ``f(i)`` counts them.
The loss is on the answers (``v`` after ``ASK k``) only; the filler is noise no model can predict.

A record is one token so that one attention layer can match the asked key and copy the value from it.
Records of a key token followed by a value token need an induction circuit (two composed layers: find the
asked key, then read the token after it), which no 2-layer model formed within 3,000 steps in any
configuration tried (docs/probing.md).

Document lengths, in tokens, come from one of three distributions over a window ``L``:

* ``natural``: log-normal (as web text: most documents short, a few long), truncated at ``L``;
* ``uniform``: uniform on ``[MIN_DOCUMENT, L]``;
* ``concat``: natural lengths, documents packed one after another to fill each row (attention crosses
  documents and positions run on, as in packed pretraining; records and queries stay inside their document).

Under ``natural`` and ``uniform`` each document is a sequence of its own: several share a row, but with
``position_ids`` restarting at 0 each document attends only to itself (transformers builds the
block-diagonal mask from the position ids), which is one document per row without the padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

PAD, BOS, KEY, ASK = range(4)
SPECIAL = 4
FILLER = 32  # filler tokens: noise between records
KEYS = 8  # keys are drawn from these, distinct within a document
VALUES = 8  # values from these
FIRST_KEY = SPECIAL + FILLER
FIRST_VALUE = FIRST_KEY + KEYS
FIRST_RECORD = FIRST_VALUE + VALUES  # one token per (key, value): KEYS x VALUES of them
VOCAB = FIRST_RECORD + KEYS * VALUES
RECORD = 3  # the tokens an item takes: a query ASK k v, a record KEY r and one filler token
MIN_DOCUMENT = 4 * RECORD
EVERY = 8  # two items (records or queries) per this many tokens of document
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
            raise ValueError(
                f"median={self.median} and sigma={self.sigma} are out of range: 0 < median <= 1, 0 < sigma <= 4"
            )

    def lengths(self, count: int, rng: np.random.Generator) -> np.ndarray:
        """``count`` document lengths in ``[MIN_DOCUMENT, window]``."""
        if self.distribution == "uniform":
            return rng.integers(MIN_DOCUMENT, self.window + 1, size=count)
        drawn = rng.lognormal(np.log(self.median * self.window), self.sigma, size=count)
        return np.clip(np.round(drawn), MIN_DOCUMENT, self.window).astype(np.int64)

    def batch(self, rows: int, rng: np.random.Generator) -> dict[str, torch.Tensor]:
        """About ``rows`` windows of documents: ``input_ids``, ``labels`` (answers only) and ``position_ids``,
        ``[rows', window]`` each, and ``lengths``: every document's length.

        ``natural`` and ``uniform`` draw documents until they hold ``rows * window`` tokens and pack them
        (first fit, longest first) into as many rows as that takes, each document at positions from 0;
        ``concat`` fills exactly ``rows`` rows end to end, positions running on, the last document of a
        row cut where the row ends. What is left of a row is padding (its own positions, no loss).
        """
        if self.distribution == "concat":
            return self._concatenated(rows, rng)
        documents, total = [], 0
        while total < rows * self.window:
            documents.append(int(self.lengths(1, rng)[0]))
            total += documents[-1]
        room, packed = [], []  # per row: free tokens, and its documents' lengths
        for length in sorted(documents, reverse=True):
            row = next((r for r, free in enumerate(room) if free >= length), None)
            if row is None:
                room.append(self.window)
                packed.append([])
                row = len(room) - 1
            room[row] -= length
            packed[row].append(length)
        ids, labels, positions = self._empty(len(packed))
        lengths = []
        for row, row_lengths in enumerate(packed):
            start = 0
            for length in rng.permutation(row_lengths).tolist():  # in random order along the row
                tokens, answers = document(length, rng)
                ids[row, start : start + length], labels[row, start : start + length] = tokens, answers
                positions[row, start : start + length] = np.arange(length)
                lengths.append(length)
                start += length
            positions[row, start:] = np.arange(self.window - start)
        return _tensors(ids, labels, positions, lengths)

    def _concatenated(self, rows: int, rng: np.random.Generator) -> dict[str, torch.Tensor]:
        ids, labels, positions = self._empty(rows)
        positions[:] = np.arange(self.window)
        lengths = []
        for row in range(rows):
            start = 0
            while start < self.window - MIN_DOCUMENT:
                length = min(int(self.lengths(1, rng)[0]), self.window - start)
                tokens, answers = document(length, rng)
                ids[row, start : start + length], labels[row, start : start + length] = tokens, answers
                lengths.append(length)
                start += length
        return _tensors(ids, labels, positions, lengths)

    def _empty(self, rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        shape = (rows, self.window)
        return (
            np.full(shape, PAD, dtype=np.int64),
            np.full(shape, IGNORE, dtype=np.int64),
            np.zeros(shape, dtype=np.int64),
        )


def _tensors(ids, labels, positions, lengths) -> dict[str, torch.Tensor]:
    return {
        "input_ids": torch.from_numpy(ids),
        "labels": torch.from_numpy(labels),
        "position_ids": torch.from_numpy(positions),
        "lengths": torch.tensor(lengths),
    }


def document(length: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """One document of ``length`` tokens: BOS, filler, records, and queries for records before them.

    Returns the tokens and their labels (the answer ``v`` of each query; ``IGNORE`` elsewhere). Records and
    queries take random non-overlapping places after BOS (any gap, not a grid); the first is a record, each
    later one a record or a query by a coin flip, and a query asks for a record before it drawn uniformly
    (some records are asked twice, some never, as the probe's distractors never are: no answer follows from
    which values are still unasked). The distance between a query and its record ranges over the document.
    """
    tokens = rng.integers(SPECIAL, SPECIAL + FILLER, size=length)
    tokens[0] = BOS  # every document starts with one, as in packed pretraining
    labels = np.full(length, IGNORE, dtype=np.int64)
    items = min(max(2, 2 * length // EVERY), (length - 1) // RECORD)
    filler = length - 1 - items * RECORD
    # the places of the items among filler + items units, each item RECORD tokens long
    places = 1 + np.sort(rng.choice(filler + items, size=items, replace=False)) + np.arange(items) * (RECORD - 1)
    is_query = rng.random(items) < 0.5
    is_query[0] = False
    is_query[-1] |= not is_query.any()  # at least one query
    keys, values = _keys_and_values(min(int((~is_query).sum()), KEYS), rng)
    records = []  # (key, value) of the records so far
    for place, query in zip(places, is_query, strict=True):
        if query or len(records) == len(keys):
            key, value = records[rng.integers(len(records))]
            tokens[place : place + RECORD] = (ASK, key, value)
            labels[place + 2] = value
        else:
            key, value = keys[len(records)], values[len(records)]
            records.append((key, value))
            tokens[place : place + 2] = (KEY, record_token(key, value))
    return tokens, labels


def record_token(key: int, value: int) -> int:
    """The one token of the record of ``key`` and ``value`` (both token ids)."""
    return FIRST_RECORD + (key - FIRST_KEY) * VALUES + (value - FIRST_VALUE)


def key_and_value(record: int) -> tuple[int, int]:
    """The key and value token ids a record token holds (:func:`record_token` undone)."""
    index = record - FIRST_RECORD
    return FIRST_KEY + index // VALUES, FIRST_VALUE + index % VALUES


def _keys_and_values(count: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """``count`` distinct keys and a value for each."""
    return rng.choice(KEYS, size=count, replace=False) + FIRST_KEY, rng.integers(
        FIRST_VALUE, FIRST_VALUE + VALUES, size=count
    )


def retrieval_case(window: int, distance: int, needles: int, rng: np.random.Generator) -> tuple[np.ndarray, int, int]:
    """A probe of ``window`` tokens: filler, ``needles`` records with distinct keys, and at the end a query for
    the one whose record starts ``distance`` tokens before the query; the others sit at random places.

    Returns ``(tokens, position, answer)``: the query's answer ``v`` is predicted at ``position`` (the
    logits of the key ``k`` before it).
    """
    query = window - RECORD
    target = query - distance
    if not (target >= 1 and distance >= RECORD):
        raise ValueError(f"distance={distance} is out of range: {RECORD} .. {query - 1} for a window of {window}")
    tokens = rng.integers(SPECIAL, SPECIAL + FILLER, size=window)
    tokens[0] = BOS
    keys, values = _keys_and_values(needles, rng)
    taken = [(target, target + RECORD), (query, window)]
    for key, value, index in zip(keys, values, range(needles), strict=True):
        start = target if index == 0 else _free_start(taken, 1, query - RECORD, rng)
        if index:
            taken.append((start, start + RECORD))
        tokens[start : start + 2] = (KEY, record_token(key, value))
    tokens[query : query + RECORD] = (ASK, keys[0], values[0])
    return tokens, query + 1, int(values[0])


def _free_start(taken: list[tuple[int, int]], low: int, high: int, rng: np.random.Generator) -> int:
    """A start in ``[low, high]`` whose record overlaps none of ``taken``."""
    for _ in range(1000):
        start = int(rng.integers(low, high + 1))
        if all(start + RECORD <= a or start >= b for a, b in taken):
            return start
    raise ValueError("no room for another record: use fewer needles or a longer window")

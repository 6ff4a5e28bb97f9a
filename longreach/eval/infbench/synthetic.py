"""InfiniteBench's synthetic retrieval records, built as OpenBMB/InfiniteBench's
``data/construct_synthetic_dataset.py`` builds them (``build_passkey``, ``build_number_string``,
``build_kv_retrieval``), from a given random stream: each function draws from ``rng`` exactly what upstream draws from
the ``random`` module, in the same order, so upstream's loops over these functions with ``random.seed(s)`` give its
files (tests/test_infbench.py checks it)."""

from __future__ import annotations

import random
import uuid
from functools import lru_cache

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"
NEEDLES = {
    "passkey": ("The pass key is {key}. Remember it. {key} is the pass key.\n", "What is the pass key?"),
    "number_string": (
        "The sequence of digits is {key}. Remember it. {key} is the sequence of digits.\n",
        "What is the sequence of digits?",
    ),
}
POSITIONS = {"passkey": 59, "number_string": 59, "kv_retrieval": 500}
"""Where upstream puts the needle: after 59 evenly spaced numbers of lines (``range(0, lines + 1, step)``: 5,220 lines
in steps of 90 at 128K, the first line to the last), and the 500 samples' answers at pair ``int(sample * pairs /
500)``."""
KV_KEYS = 3000  # lost-in-the-middle's make_kv_retrieval_data.py --num-keys 3000, which upstream reads


def passkey_key(rng: random.Random) -> str:
    """Five digits, each ``randint(0, 9)``."""
    return "".join(str(rng.randint(0, 9)) for _ in range(5))


def number_string_key(rng: random.Random) -> str:
    """Five digits, then five times a digit doubled in place (``keys.insert(pos, keys[pos])``): ten digits with
    repeats."""
    keys = [str(rng.randint(0, 9)) for _ in range(5)]
    for k in range(5):
        at = rng.randint(0, 5 + k - 1)
        keys.insert(at, keys[at])
    return "".join(keys)


KEYS = {"passkey": passkey_key, "number_string": number_string_key}


def retrieval_record(task: str, key: str, lines: int, before: int) -> dict:
    """A passkey or number_string record: ``before`` noise lines, the needle line with ``key`` twice, the other
    ``lines - before`` lines; ``len`` as upstream counts it (26 per noise line after the needle)."""
    needle, question = NEEDLES[task]
    context = (NOISE * before + needle + NOISE * (lines - before)).replace("{key}", key)
    return {"input": question, "context": context, "answer": key, "len": 26 * (lines - before)}


def kv_pairs(rng: random.Random, count: int) -> list[list[str]]:
    """``count`` distinct key-value pairs of UUID4 strings, as lost-in-the-middle's ``make_kv_retrieval_data.py``
    makes its records (drawn here from ``rng``, where upstream's ``uuid4`` reads the operating system's entropy)."""
    pairs: dict[str, str] = {}
    while len(pairs) < count:
        pairs[_uuid(rng)] = _uuid(rng)
    return [list(pair) for pair in pairs.items()]


def _uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def kv_record(rng: random.Random, pairs: list[list[str]], shown: int, answer: int) -> dict:
    """A kv_retrieval record as ``build_kv_retrieval`` makes it: ``pairs`` shuffled in place, the first ``shown``
    written as one JSON object, and the key of pair ``answer`` (of the shuffled list) asked."""
    rng.shuffle(pairs)
    text = "JSON data:\n{" + "".join(f'"{key}": "{value}", ' for key, value in pairs[:shown])
    question = '\nKey: "' + pairs[answer][0] + '"\nThe value associated with the specified key is: '
    return {"context": text[:-2] + "}", "input": question, "answer": pairs[answer][1]}


def needle_at(task: str, seed: int) -> float:
    """Where case ``seed`` puts its needle, as a fraction of the lines (passkey, number_string: ``k / 58``) or pairs
    (kv_retrieval: ``k / 500``) before it: upstream's position ``k = coarse_to_fine(P)[seed mod P]``."""
    positions = POSITIONS[task]
    k = coarse_to_fine(positions)[seed % positions]
    return k / positions if task == "kv_retrieval" else k / (positions - 1)


@lru_cache(maxsize=4)
def coarse_to_fine(positions: int) -> tuple[int, ...]:
    """The ``positions`` needle positions in an order whose every prefix spreads over them, so that a run of a few
    cases covers every depth; the first ``positions`` cases visit each once. It is the bit-reversed order of ``0 ..
    2^b - 1`` (``2^b``: the first power of two at or above ``positions``) with the numbers past the last position left
    out: of 59 positions 0, 32, 16, 48, 8, 40, ... (32 of 58 is not the exact middle), of 500 0, 256, 128, 384, ..."""
    bits = max(1, (positions - 1).bit_length())
    reversed_ = (int(f"{i:0{bits}b}"[::-1], 2) for i in range(2**bits))
    return tuple(i for i in reversed_ if i < positions)

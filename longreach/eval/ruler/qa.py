"""RULER's question answering over SQuAD and HotpotQA documents (``qa.py``)."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from functools import lru_cache
from typing import ClassVar

from .. import haystack, string_match
from ..case import Case
from ..task_protocol import GENERATE
from .common import FIXED_SEED, case, fit, postprocess, stream_name

QA_TEMPLATE = (
    "Answer the question based on the given documents. Only give me the answer and do not output any other words."
    "\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the given documents. "
    "Only give me the answer and do not output any other words.\n\nQuestion: {query}"
)
QA_ANSWER = " Answer:"


@dataclass(frozen=True)
class QA:
    """RULER ``qa_1`` (SQuAD v2 dev) / ``qa_2`` (HotpotQA dev, distractor setting), ``qa.py``.

    Case ``i`` asks question ``i`` of the dataset, as RULER's sample ``i`` does. Its gold documents
    come first -- for HotpotQA all the question's paragraphs (2 to 10); for SQuAD the paragraph, then the
    other paragraphs of its article -- then random documents of the rest, shuffled together
    (:func:`rulers_documents`, drawn afresh for every size the search probes and every back-off, as
    upstream's; packed tight, one order per case whose first ``n`` documents grow with ``n``).
    """

    name: str
    kind: ClassVar[str] = GENERATE
    token_ids: ClassVar[bool] = False
    templated: ClassVar[bool] = True  # its prompt is RULER's model template around the task text
    dataset: str
    uses_depth: bool = False
    max_new_tokens: int = 32
    metric: str = "string_match_part"
    packing: str = "ruler"

    def build(self, tokenizer, length: int, depth: float | None, seed: int) -> Case:
        questions, documents = qa_data(self.dataset)
        if seed >= len(questions):
            raise ValueError(
                f"{self.name}: sample {seed} is out of range: the {self.dataset} set has {len(questions)} questions"
            )
        orders = {}

        def chosen(item: dict, n: int, stream: str) -> list[int]:
            if self.packing == "ruler":  # drawn afresh: the stream names the size
                return rulers_documents(
                    random.Random(f"{stream_name(self)}/{length}/{stream}"), item, n, len(documents)
                )
            key = stream.rsplit("/", 1)[0]
            if key not in orders:
                rng = random.Random(f"{stream_name(self)}/{length}/{key}")
                others = sorted(set(range(len(documents))) - set(item["documents"] + item["article"]))
                orders[key] = (
                    item["documents"]
                    + rng.sample(item["article"], len(item["article"]))
                    + rng.sample(others, len(others))
                )
            return in_article_order(orders[key][:n], item)

        def prompt_of(n: int, stream: str) -> str:
            item = questions[0 if stream.startswith("search/") else seed]  # RULER searches on question 0
            shown = [documents[i] for i in chosen(item, max(n, len(item["documents"])), stream)]
            random.Random(FIXED_SEED).shuffle(shown)
            context = "\n\n".join(f"Document {i + 1}:\n{d}" for i, d in enumerate(shown))
            return haystack.with_bos(
                tokenizer,
                haystack.templated(tokenizer, QA_TEMPLATE.format(context=context, query=item["question"]), QA_ANSWER),
            )

        built = fit(
            self,
            tokenizer,
            length,
            seed,
            prompt_of,
            haystack.RulerSearch(10),
            start=max(len(questions[seed]["documents"]), length // 200),
            most=len(documents),
            unit=f"{self.dataset} documents",
        )
        return case(self, length, seed, built, questions[seed]["answers"])

    def score(self, answer: str, case: Case) -> dict:
        return {"score": string_match.string_match_part(postprocess(answer), case.references)}


def rulers_documents(rng: random.Random, item: dict, n: int, total: int) -> list[int]:
    """The ``n`` documents of a question, as RULER's ``generate_input_output`` draws them (``qa.py:130-137``):
    the gold ones, then -- when the rest of the article fits whole -- all of it in article order and a random
    sample of the other documents, else a random sample of the article."""
    gold, article = item["documents"], item["article"]
    if n - len(gold) > len(article):
        taken = set(gold + article)
        others = [i for i in range(total) if i not in taken]
        return gold + article + rng.sample(others, n - len(gold) - len(article))
    return gold + rng.sample(article, n - len(gold))


def in_article_order(chosen: list[int], item: dict) -> list[int]:
    """``chosen`` (a prefix of one order of all documents) with its article in article order where the whole
    article is in it (``qa.py:133``)."""
    gold, article = item["documents"], item["article"]
    if len(chosen) - len(gold) > len(article):
        return gold + article + chosen[len(gold) + len(article) :]
    return chosen


@lru_cache(maxsize=2)
def qa_data(dataset: str) -> tuple[list[dict], list[str]]:
    """RULER's ``read_squad`` / ``read_hotpotqa``: questions (gold document indices, same-article
    paragraphs, answers) and the sorted pool of distinct documents."""
    raw = json.loads((haystack.ruler_data_folder() / f"{dataset}.json").read_text(encoding="utf-8"))
    if dataset == "squad":
        documents = sorted({p["context"] for d in raw["data"] for p in d["paragraphs"]})
        index = {c: i for i, c in enumerate(documents)}
        questions = []
        for article in raw["data"]:
            paragraphs = [index[p["context"]] for p in article["paragraphs"]]
            for p in article["paragraphs"]:
                gold = index[p["context"]]
                questions += [
                    {
                        "question": qa["question"],
                        "answers": [a["text"] for a in qa["answers"]],
                        "documents": [gold],
                        "article": [i for i in paragraphs if i != gold],
                    }
                    for qa in p["qas"]
                    if not qa["is_impossible"]
                ]
        return questions, documents

    def text(title, sentences):
        return f"{title}\n{''.join(sentences)}"

    documents = sorted({text(t, s) for item in raw for t, s in item["context"]})
    index = {c: i for i, c in enumerate(documents)}
    questions = [
        {
            "question": item["question"],
            "answers": [item["answer"]],
            "article": [],
            "documents": [index[text(t, s)] for t, s in item["context"]],
        }
        for item in raw
    ]
    return questions, documents


def qa_available() -> str | None:
    """``None`` when RULER's data is installed, else the one-line reason QA tasks are left out."""
    try:
        haystack.ruler_data_folder()
    except RuntimeError:
        return f"qa_1/qa_2 left out: RULER's QA data is not installed ({haystack.RULER_DATA_INSTALL})"
    return None

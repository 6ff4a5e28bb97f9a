"""InfiniteBench's tasks as cases: the three synthetic retrieval tasks generated at any length, the others read from
the published records; every prompt as STRING's script makes it, cut in the middle to the length."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar

from .. import haystack
from ..case import Case
from ..task_protocol import GENERATE
from . import data, prompts, scoring, synthetic

MAX_NEW_TOKENS = {  # eval_utils.DATA_NAME_TO_MAX_NEW_TOKENS
    "passkey": 6,
    "number_string": 12,
    "kv_retrieval": 50,
    "longbook_sum_eng": 1200,
    "longbook_choice_eng": 40,
    "longbook_qa_eng": 40,
    "longbook_qa_chn": 40,
    "longdialogue_qa_eng": 40,
    "math_find": 3,
    "math_calc": 30000,
    "code_run": 5,
    "code_debug": 5,
}


@dataclass(frozen=True)
class InfiniteBenchTask:
    """One of InfiniteBench's 12 tasks (``task``: upstream's name) with STRING's prompts for ``template``
    (``llama3.1``: plain text; ``qwen2``: the same opened by ``<|im_start|>``).

    The prompt plus the task's tokens to generate fit the length: the prompt is cut to ``length -
    max_new_tokens`` tokens as ``truncate_by_tokens`` cuts it (upstream cuts to 128K and generates past it).
    The answer's whitespace is joined, as ``get_pred`` does, and scored by upstream's rule for the task, x 100.
    """

    name: str
    task: str
    template: str = "llama3.1"
    kind: ClassVar[str] = GENERATE
    token_ids: ClassVar[bool] = False
    uses_depth: ClassVar[bool] = False

    @property
    def max_new_tokens(self) -> int:
        return MAX_NEW_TOKENS[self.task]

    @property
    def synthetic(self) -> bool:
        return self.task in synthetic.POSITIONS

    def build(self, tokenizer, length: int, depth: float | None, seed: int) -> Case:
        budget = length - self.max_new_tokens
        if budget < 1:
            raise ValueError(
                f"{self.name} generates up to {self.max_new_tokens} tokens: a length must be more than that, not "
                f"{length}"
            )
        if self.synthetic:
            return self._generated(tokenizer, length, budget, seed)
        rows = data.records(self.task)
        if seed >= len(rows):
            raise ValueError(f"{self.name}: sample {seed} is out of range: {self.task}.jsonl has {len(rows)} records")
        record = rows[seed]
        prompt, tokens = prompts.truncated(tokenizer, prompts.create_prompt(record, self.task, self.template), budget)
        return self._case(length, seed, prompt, tokens, answer(record, self.task))

    def _generated(self, tokenizer, length: int, budget: int, seed: int) -> Case:
        """A synthetic record as large as the budget holds (noise lines or key-value pairs), its needle where
        :func:`.synthetic.needle_at` puts case ``seed``, its key from the case's own stream."""
        at = synthetic.needle_at(self.task, seed)
        stream = f"{self.name}/{length}/{seed}"
        records = {}

        def prompt_of(n: int) -> str:
            rng = random.Random(stream)
            if self.task == "kv_retrieval":
                pairs = synthetic.kv_pairs(rng, max(n, synthetic.KV_KEYS))
                records[n] = synthetic.kv_record(rng, pairs, n, int(at * n))
            else:
                records[n] = synthetic.retrieval_record(self.task, synthetic.KEYS[self.task](rng), n, round(at * n))
            return prompts.truncated(tokenizer, prompts.create_prompt(records[n], self.task, self.template), None)[0]

        unit = "key-value pairs" if self.task == "kv_retrieval" else "noise lines"
        n, prompt, tokens = haystack.fit_largest(
            tokenizer, budget, prompt_of, start=max(2, budget // 60), what=f"{self.name} at {length} tokens", unit=unit
        )
        case = self._case(length, seed, prompt, tokens, records[n]["answer"])
        case.needle_depths, case.haystack_units = [at], n
        return case

    def _case(self, length: int, seed: int, prompt: str, tokens: int, label) -> Case:
        references = label if isinstance(label, list) else [label]
        return Case(
            self.name, length, None, seed, prompt, references, self.max_new_tokens, tokens, scoring.METRICS[self.task]
        )

    def score(self, answer: str, case: Case) -> dict:
        """Upstream's rule on the label as a list (every rule takes one: a single answer is its first item)."""
        return {"score": 100.0 * float(scoring.SCORERS[self.task](" ".join(answer.split()), case.references))}


def answer(record: dict, task: str):
    """``eval_utils.get_answer`` on a record :func:`.data.problem` accepts: multiple choice gives ``[option text,
    letter]`` (from the answer text, or an answer that is that pair already); every other task its record's answer as
    it is."""
    if task not in data.CHOICE:
        return record["answer"]
    given, options = record["answer"], record["options"]
    if isinstance(given, list) and len(given) == 2:
        return given
    text = given[0] if isinstance(given, list) else given
    return [text, "ABCD"[options.index(text)]]

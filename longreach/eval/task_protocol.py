"""What a task is: the protocol every task of the registry (:mod:`.tasks`) follows, as lm-evaluation-harness's ``Task``.

A task builds a deterministic case from ``(tokenizer, length, depth, seed)`` and declares its ``kind``:

* ``generate`` (:class:`GeneratedTask`): the runner decodes the answer greedily, up to ``max_new_tokens``, cases
  of one length in batches, and the task scores it (``score``);
* ``evaluate`` (:class:`EvaluatedTask`): the task measures the case on the model itself, one case at a time
  (``evaluate``: perplexity, a probe checkpoint's next token).

A generated task whose prompt is the model template around its text (:func:`.haystack.templated`) says so with
``templated = True``: ``--template``, ``--chat-template-kwargs`` and ``--thinking`` dress its prompts
(:mod:`.prompt_form`); the others' prompts are the bare text by definition.
"""

from __future__ import annotations

from typing import ClassVar, Literal, Protocol

from .case import Case

GENERATE = "generate"
EVALUATE = "evaluate"


class Task(Protocol):
    """What every task has, whatever its kind."""

    kind: ClassVar[str]  # GENERATE or EVALUATE
    token_ids: ClassVar[bool]  # its prompts are token ids: it needs no tokenizer (a probe checkpoint has none)

    @property
    def name(self) -> str: ...

    @property
    def uses_depth(self) -> bool:
        """Whether its cases sit at the grid's depths (case ``i`` at ``depths[i % len(depths)]``)."""

    @property
    def max_new_tokens(self) -> int:
        """Tokens to generate, held back from the length."""

    def build(self, tokenizer, length: int, depth: float | None, seed: int) -> Case:
        """The case of ``(length, depth, seed)``: the same every time."""


class GeneratedTask(Task, Protocol):
    """A task whose answer the runner generates and the task scores."""

    kind: ClassVar[Literal["generate"]]

    def score(self, answer: str, case: Case) -> dict:
        """The record's fields for ``answer``: ``score`` (0 .. 100) and whatever the task adds."""


class EvaluatedTask(Task, Protocol):
    """A task that measures a case on the model itself."""

    kind: ClassVar[Literal["evaluate"]]

    def evaluate(self, model, tokenizer, case: Case) -> dict:
        """The record's fields for ``case``: ``score`` and ``answer`` at least."""


AnyTask = GeneratedTask | EvaluatedTask

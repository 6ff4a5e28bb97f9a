"""One evaluation case: a prompt, what a correct answer must contain, and how much it may generate."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Case:
    task: str
    length: int  # the budget: n_tokens + max_new_tokens <= length
    depth: float | None  # the grid depth the case was asked for (None: the task draws its own)
    seed: int
    prompt: str  # exactly what the model reads (BOS and chat template included), tokenized without special tokens
    references: list[str]
    max_new_tokens: int
    n_tokens: int
    metric: str = "string_match_all"
    needle_depths: list[float] = field(default_factory=list)  # where each reference was placed, 0 = start, 1 = end
    haystack_units: int = 0  # the haystack's size in the task's units (words, lines, documents, characters)
    searched_units: int | None = (
        None  # ruler:* only: the size RULER's search found for the task and length, which cases back off from
    )

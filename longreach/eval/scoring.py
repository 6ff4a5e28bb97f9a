"""Scoring rules: RULER's string matching (Hsieh et al. 2024) and the STRING paper's 4-needle rule."""

from __future__ import annotations


def string_match_all(answer: str, references: list[str]) -> float:
    """RULER ``string_match_all``: percent of the references found in the answer (case-insensitive)."""
    text = answer.lower()
    return 100.0 * sum(ref.lower() in text for ref in references) / len(references)


def string_match_part(answer: str, references: list[str]) -> float:
    """RULER ``string_match_part``: 100 if any reference is found in the answer, else 0."""
    text = answer.lower()
    return 100.0 * any(ref.lower() in text for ref in references)


def needles_found(answer: str, references: list[str]) -> list[bool]:
    text = answer.lower()
    return [ref.lower() in text for ref in references]


def at_least(answer: str, references: list[str], needed: int) -> float:
    """The STRING paper's multi-needle rule: a case passes (100) when ``needed`` needles come back."""
    return 100.0 * (sum(needles_found(answer, references)) >= needed)


METRICS = {"string_match_all": string_match_all, "string_match_part": string_match_part}

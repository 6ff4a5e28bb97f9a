"""RULER's string matching (NVIDIA/RULER ``scripts/eval/synthetic/constants.py``), per case, in percent."""

from __future__ import annotations


def string_match_all(answer: str, references: list[str]) -> float:
    """Percent of the references found in the answer (case-insensitive substrings)."""
    return 100.0 * sum(needles_found(answer, references)) / len(references)


def string_match_part(answer: str, references: list[str]) -> float:
    """100 if any reference is found in the answer, else 0."""
    return 100.0 * any(needles_found(answer, references))


def needles_found(answer: str, references: list[str]) -> list[bool]:
    text = answer.lower()
    return [ref.lower() in text for ref in references]

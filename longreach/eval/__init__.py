"""Evaluation: haystacks, tasks, the resumable runner, reports."""

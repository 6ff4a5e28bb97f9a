"""longreach's vLLM plugin by a short path: ``from longreach.vllm import overrides``, then ``LLM(model,
hf_overrides=overrides("string"))``. The plugin itself is :mod:`longreach.integrations.vllm` (docs/vllm.md)."""

from __future__ import annotations

from .integrations.vllm import Overrides, overrides, prepare

__all__ = ["Overrides", "overrides", "prepare"]

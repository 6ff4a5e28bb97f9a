"""What every test module gets: Triton's interpreter on a machine without CUDA, and the ``family`` fixture. What tests
share to import -- reference cases, tiny models, emulations -- is in tests/helpers/ (``from helpers.x import y``:
pytest puts tests/ on ``sys.path``, as this file has no package above it)."""

from __future__ import annotations

import os

import pytest
import torch

if (
    not torch.cuda.is_available()
):  # the fused Triton kernel runs under Triton's interpreter (read when a kernel is defined)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from helpers.tiny_models import FAMILIES  # noqa: E402  (imports transformers: after the interpreter's switch)


@pytest.fixture(params=sorted(FAMILIES))
def family(request) -> str:
    return request.param

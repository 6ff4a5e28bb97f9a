"""The transformers engine (the default): the model loaded in this process, a method applied per batch
(:func:`longreach.eval.on_model.apply`), cases decoded greedily by :mod:`longreach.eval.generate`.

Under ``torchrun`` each process loads the whole model and runs its share of the cases, or with ``--tp`` the model is
sharded over them (:mod:`longreach.eval.distributed`).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

from ..task_protocol import EVALUATE
from .base import Engine

if TYPE_CHECKING:
    from ...methods.spec import MethodSpec


class Transformers(Engine):
    """The model of ``grid.model`` loaded in this process, or ``loaded``, a ``(model, tokenizer)`` already loaded (its
    methods are removed again at :meth:`close`). ``prefill_tokens``: read the prompts in chunks of at most this many
    tokens over the batch (0: in one forward; ``None``: 4096 for a batch, one forward for a lone case)."""

    name = "transformers"

    def __init__(self, loaded: tuple | None = None, prefill_tokens: int | None = None):
        if prefill_tokens is not None and prefill_tokens < 0:
            raise ValueError(
                f"--prefill-tokens={prefill_tokens} is out of range: at least 0 (0: a prompt in one forward)"
            )
        self.loaded, self.prefill_tokens = loaded, prefill_tokens
        self.model = None
        self.specs: dict[str, MethodSpec] = {}
        self.applied, self.warmed = None, False

    def start(self, grid, world) -> dict[str, str]:
        """Every method checked on an empty model of the config first (a typo must not wait for the weights), then the
        weights loaded on this process's device, in ``grid.dtype``, and each method applied once to resolve it."""
        import torch
        import transformers

        from ... import models
        from ...integrations.transformers import describe, training_window
        from .. import on_model, tasks

        if self.loaded is None:
            on_model.check(grid.methods, models.load_config(grid.model), grid.training_window)
        weights = grid.dtype if grid.dtype == "auto" else getattr(torch, grid.dtype)
        self.model, self.tokenizer = self.loaded or models.load(
            grid.model, dtype=weights, device=world.device(), tp=world.tp
        )
        if self.tokenizer is None and (text := [t for t in grid.tasks if not tasks.get(t).token_ids]):
            raise ValueError(
                f"model {grid.model} has no tokenizer (a probe checkpoint): {', '.join(text)} needs one; its "
                f"tasks are {' and '.join(tasks.token_id_tasks())}"
            )
        self.config = self.model.config
        self.dtype = str(self.model.dtype).removeprefix("torch.")
        self.window = grid.training_window or training_window(self.model.config)
        device = self.model.device  # the time per case depends on it
        self.machine = f"cuda: {torch.cuda.get_device_name(device)}" if device.type == "cuda" else device.type
        self.record = {"engine": self.name, "engine_version": transformers.__version__}
        self.specs = {spec.label: spec for spec in grid.methods}
        resolved = {}
        for spec in grid.methods:
            on_model.apply(self.model, spec, self.window)
            resolved[spec.label] = describe(self.model)
        return resolved

    def ready(self, label: str) -> None:
        """The method applied, and the first time the one-time set-up, on a line of its own (a first case's time must
        not hold the kernel's build)."""
        from .. import on_model
        from ..generate import set_up_line, warm_up

        if self.applied != label:
            on_model.apply(self.model, self.specs[label], self.window)
            self.applied = label
        if not self.warmed:
            self.warmed = True
            print(set_up_line(warm_up(self.model)), file=sys.stderr, flush=True)

    def decode(self, task, label: str, cases: list) -> Iterator[tuple[int, dict]]:
        """A batch decoded together (left-padded); a method whose frequencies follow the forward's longest sequence
        (dynamic NTK) decodes each case alone, in one forward, so that its answer is its own whatever the batch."""
        from ...integrations.transformers import one_case_per_forward
        from .. import generate

        self.ready(label)
        if task.kind == EVALUATE:
            yield from enumerate(task.evaluate(self.model, self.tokenizer, case) for case in cases)
            return
        per_case = one_case_per_forward(self.model)
        alone = per_case and len(cases) > 1
        budget = 0 if per_case else generate.prefill_budget(len(cases), self.prefill_tokens)
        groups = [[case] for case in cases] if alone else [cases]
        prompts = [[case.prompt for case in group] for group in groups]
        model, tokenizer = self.model, self.tokenizer
        answers = [a for p in prompts for a in generate.greedy(model, tokenizer, p, task.max_new_tokens, budget)]
        extra = {"prefill_tokens": budget, **({"batch": 1} if alone else {})}
        yield from enumerate({"answer": answer, **extra} for answer in answers)

    def close(self) -> None:
        """The methods removed from the model (a model passed in as ``loaded`` is the caller's again)."""
        from ...integrations.transformers import remove

        if self.model is not None:
            remove(self.model)

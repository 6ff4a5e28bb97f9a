"""What an evaluation engine is: the contract :func:`longreach.eval.runner.run` drives, whatever runs the model.

As lm-evaluation-harness's ``LM`` (``lm_eval/api/model.py``): one abstract class whose docstrings state the contract,
and one driver for every implementation. The engines here are transformers in this process
(:mod:`.transformers`), vLLM's offline engine (:mod:`.vllm`) and an OpenAI-compatible server (:mod:`.server`); a new
one (SGLang, TensorRT-LLM) is one more module.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from ..case import Case
    from ..distributed import World
    from ..grid import Grid
    from ..task_protocol import AnyTask


class EngineGone(RuntimeError):
    """The engine stopped answering: the run stops with one line; every finished case is saved, and a rerun goes on."""


class Engine(ABC):
    """Runs an evaluation's cases. The driver calls :meth:`start` once, then for each batch (cases of one task, one
    length and one method) :meth:`ready` and :meth:`decode`, and :meth:`close` at the end, after an error too.

    Every engine decodes greedily (no sampling) up to the task's ``max_new_tokens``, from the case's prompt as the
    model's own tokenizer reads it without special tokens (the prompt holds BOS and the chat template already), and
    decodes the answer without special tokens, stripped: the same tokens in, the same text out, whichever engine runs
    (``tests/test_vllm_eval.py``).

    After :meth:`start`, an engine holds:

    * ``tokenizer``: the model's tokenizer, which builds the cases (``None`` for a checkpoint without one, whose tasks
      are token ids);
    * ``config``: the model's config, for the run's provenance;
    * ``window``: ``L``, the training window the methods and the lengths are read against;
    * ``dtype``: the precision the cases run in, as each record keeps it (a results folder holds one);
    * ``machine``: where they run (``cpu``, ``cuda: <GPU>``, ``server <url>``);
    * ``record``: the fields every record of this engine carries (``engine``, ``engine_version``, and its own).
    """

    name: ClassVar[str]
    """The engine's name, which each record keeps as ``engine``: a results folder holds one engine's cases."""

    one_method_at_a_time: ClassVar[bool] = False
    """Whether the driver takes the cases method by method (an engine that holds one method, where switching costs a
    start), rather than in grid order."""

    tokenizer: Any
    config: Any
    window: int
    dtype: str
    machine: str
    record: dict[str, str]

    @abstractmethod
    def start(self, grid: Grid, world: World) -> dict[str, str]:
        """Set up for ``grid`` in this process's place ``world``: the model (or a connection to it), the attributes
        above, and every method of ``grid.methods`` checked, so that a method the engine cannot run is one
        ``ValueError`` line before any case.

        Returns:
            Each method's label -> the method as resolved (every parameter and ``L``), which keys its records: a rerun
            finds them done by it.
        """

    @abstractmethod
    def ready(self, label: str) -> None:
        """Make the method of ``label`` the one the next batch runs under (applied to the model, or its engine
        started), before the batch is timed: a set-up must not count as a case's time. Raises if it cannot; every case
        of the batch then becomes an error row."""

    @abstractmethod
    def decode(self, task: AnyTask, label: str, cases: list[Case]) -> Iterator[tuple[int, dict]]:
        """Run ``cases`` (of one ``task`` and one length) under the method of ``label``, yielding each case's outcome
        as it is known, in any order: ``(index in cases, fields)``.

        The fields are the case's own: its ``answer`` for a generated task (the task scores it), or what an evaluated
        task's ``evaluate`` gave; or an ``error`` (a text) where that case failed while the others go on. An engine may
        add fields a record keeps (``prefill_tokens``, ``batch``: the cases decoded together where that differs from the
        batch). An exception ends the batch: every case not yet yielded becomes an error row, and :class:`EngineGone`
        ends the run (every finished case is saved, and a rerun goes on).
        """

    def close(self) -> None:  # noqa: B027 -- not abstract: an engine that holds nothing need not define it
        """Release what :meth:`start` took (weights, an engine's processes); called once, after an error too."""

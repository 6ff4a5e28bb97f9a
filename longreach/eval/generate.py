"""Greedy answers from a model, with the KV cache, one prompt or a left-padded batch; the one-time set-up before any
answer is timed."""

from __future__ import annotations

import time

import torch

BATCH_PREFILL_TOKENS = 4096  # tokens per prefill forward over a batch, by default (bench/RESULTS.md, "Chunked prefill")


def prefill_budget(batch: int, prefill_tokens: int | None) -> int:
    """The tokens a prefill forward may read over the batch: ``prefill_tokens`` as given (0: no limit), or
    by default (``None``) :data:`BATCH_PREFILL_TOKENS` for a batch and no limit for one prompt. On a CPU a
    left-padded batch of 4 prompts of 8K tokens decodes in 0.74x the time when read 1,024 tokens per
    prompt at a time (the batch's activations outgrow the cache), where one prompt of 16K tokens read in
    chunks of 4,096 takes 1.12x its time in one forward; the answers are the same."""
    if prefill_tokens is None:
        return BATCH_PREFILL_TOKENS if batch > 1 else 0
    return prefill_tokens


def prefill_chunk(prompt_tokens: int, batch: int, budget: int) -> int | None:
    """transformers' ``prefill_chunk_size`` that keeps a prefill forward within ``budget`` tokens over the
    batch; ``None`` (one forward) where the padded prompts fit, or ``budget`` is 0."""
    if budget == 0 or batch * prompt_tokens <= budget:
        return None
    return max(1, budget // batch)


@torch.no_grad()
def greedy(
    model, tokenizer, prompts: list[str], max_new_tokens: int = 32, prefill_tokens: int | None = None
) -> list[str]:
    """Greedy continuations of ``prompts`` (already templated), decoded without special tokens; the
    prompts are read in chunks of at most ``prefill_tokens`` tokens over the batch (:func:`prefill_budget`)."""
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
    batch_size, prompt_tokens = batch["input_ids"].shape
    chunk = prefill_chunk(prompt_tokens, batch_size, prefill_budget(batch_size, prefill_tokens))
    output = model.generate(
        **batch,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        temperature=None,
        top_p=None,
        top_k=None,
        pad_token_id=tokenizer.pad_token_id,
        prefill_chunk_size=chunk,
    )
    new_tokens = output[:, prompt_tokens:]
    return [text.strip() for text in tokenizer.batch_decode(new_tokens, skip_special_tokens=True)]


@torch.no_grad()
def warm_up(model) -> float:
    """What the first answer's time would otherwise hold, done once before any answer is timed: on a CPU the attention
    kernel built or found (about 25 s on 2 cores the first time, with its own line), then one forward pass of 8 tokens
    through the model as it is (a method applied: its first call's set-up). Returns the seconds it took."""
    from ..attention.backends import cpu_fused

    started = time.perf_counter()
    if model.device.type == "cpu":
        cpu_fused.ensure_built()
    model(input_ids=torch.arange(1, 9, device=model.device)[None])
    return time.perf_counter() - started


def set_up_line(seconds: float) -> str:
    """How the one-time set-up is reported, on a line of its own."""
    return f"set-up: the attention kernel and a first forward pass, {seconds:.1f} s once (in no answer's time)"

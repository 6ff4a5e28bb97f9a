"""Greedy answers from a model, with the KV cache, one prompt or a left-padded batch."""

from __future__ import annotations

import torch


@torch.no_grad()
def greedy(model, tokenizer, prompts: list[str], max_new_tokens: int = 32) -> list[str]:
    """Greedy continuations of ``prompts`` (already templated), decoded without special tokens."""
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
    output = model.generate(
        **batch, max_new_tokens=max_new_tokens, do_sample=False, temperature=None, top_p=None, top_k=None,
        pad_token_id=tokenizer.pad_token_id,
    )
    new_tokens = output[:, batch["input_ids"].shape[1] :]
    return [text.strip() for text in tokenizer.batch_decode(new_tokens, skip_special_tokens=True)]

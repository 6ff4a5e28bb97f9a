"""Run under ``torchrun``: load MODEL sharded (``models.load(tp=True)``), apply STRING, and save what
process 0 computes -- prefill logits of a left-padded batch and a greedy continuation -- to OUT."""

import sys

import torch

import longreach
from longreach import models
from longreach.eval.distributed import World


def compute(model) -> dict:
    """STRING's prefill logits and 8 greedy tokens for two rows, the second left-padded."""
    longreach.apply(model, "string", shift=16, local_window=4)
    ids = torch.arange(5, 105).reshape(2, 50) * 37 % 4000
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits
        generated = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    return {"logits": logits, "generated": generated}


if __name__ == "__main__":
    folder, out = sys.argv[1:3]
    model, _ = models.load(folder, tp=True)
    result = compute(model)
    if World.from_environment(tp=True).rank == 0:
        torch.save({**result, "sharded": type(model.model.layers[0].self_attn.q_proj.weight).__name__}, out)

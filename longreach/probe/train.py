"""Train a small Llama-shaped RoPE model on the probe corpus, on the CPU, resumably (STRING paper, section 3).

transformers' ``LlamaForCausalLM`` from a config, plain PyTorch: AdamW, linear warm-up then cosine decay,
gradient clipping. Every ``save_every`` steps a checkpoint ``OUT/step_N/`` holds the model
(``save_pretrained``, safetensors), the optimizer's moments (``optimizer.safetensors``) and ``state.json``
(the step, the loss, the corpus, the tokens seen). A rerun continues from the last checkpoint; batch ``s``
is drawn from a generator seeded by ``(seed, s)``, so an interrupted run and an uninterrupted one see the
same data.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from ..analysis.frequency import frequency
from .corpus import IGNORE, VOCAB, Corpus

STATE = "state.json"
OPTIMIZER = "optimizer.safetensors"


@dataclass(frozen=True)
class Shape:
    """The model: a Llama with RoPE, sized for a CPU."""

    layers: int = 2
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2
    rope_theta: float = 80.0
    """RoPE's base, small so that every rotary pair turns within the window (at 80 the slowest pair of a 32-wide
    head turns 4.2 radians over 256 tokens). At 10,000 it turns 0.05: nearly a position-free channel, through
    which matching a record by its content reaches every distance as soon as it reaches any (measured: 4-needle
    accuracy went from 15-45% to 98-100% at every distance within 50-100 steps, at 10,000 and at 500), so
    nothing is left for position frequency to explain; at 80 the longest distances trail, as in the paper."""

    def __post_init__(self) -> None:
        if self.hidden % self.heads or self.heads % self.kv_heads or (self.hidden // self.heads) % 2:
            raise ValueError(
                f"hidden={self.hidden}, heads={self.heads}, kv_heads={self.kv_heads} do not fit: heads must divide "
                "hidden into an even head size, and kv_heads must divide heads"
            )

    def config(self, window: int):
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=self.hidden,
            intermediate_size=4 * self.hidden,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            max_position_embeddings=window,
            rope_theta=self.rope_theta,
            tie_word_embeddings=True,
            bos_token_id=1,
            eos_token_id=None,
            pad_token_id=0,
        )


@dataclass(frozen=True)
class Schedule:
    """How long and how fast: ``steps`` of ``rows`` windows each, peak learning rate ``lr``."""

    steps: int = 2000
    rows: int = 16
    lr: float = 2e-3
    warmup: int = 100
    save_every: int = 250
    seed: int = 0

    def __post_init__(self) -> None:
        if not (0 < self.lr <= 1):  # NaN fails too
            raise ValueError(f"lr={self.lr} is out of range: 0 < lr <= 1")
        if self.seed < 0:
            raise ValueError(f"seed={self.seed} is out of range: an integer >= 0")

    def rate(self, step: int) -> float:
        """Linear warm-up, then cosine decay to a tenth of the peak."""
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        progress = (step - self.warmup) / max(1, self.steps - self.warmup)
        return self.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def train(
    corpus: Corpus, out: Path, shape: Shape = Shape(), schedule: Schedule = Schedule(), progress: bool = True
) -> Path:
    """Train (or go on training) a model on ``corpus`` into ``out``; returns the last checkpoint's folder."""
    from transformers import LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(schedule.seed)
    model = LlamaForCausalLM(shape.config(corpus.window))
    optimizer = torch.optim.AdamW(model.parameters(), lr=schedule.lr, betas=(0.9, 0.95), weight_decay=0.1)
    step, seen, lengths = 0, 0, []
    last = latest(out)
    if last is not None:
        step, seen, lengths = _resume(last, model, optimizer, corpus, shape, schedule)
    model.train()
    bar = tqdm(
        total=schedule.steps, initial=step, desc=f"train {corpus.distribution} L={corpus.window}", disable=not progress
    )
    loss_sum, loss_count = 0.0, 0
    while step < schedule.steps:
        batch = corpus.batch(schedule.rows, np.random.default_rng([schedule.seed, step]))
        for group in optimizer.param_groups:
            group["lr"] = schedule.rate(step)
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        loss = answer_loss(logits, batch["labels"])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step, seen = step + 1, seen + int(batch["lengths"].sum())
        lengths += batch["lengths"].tolist()
        loss_sum, loss_count = loss_sum + loss.item(), loss_count + 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss_sum / loss_count:.3f}")
        if step % schedule.save_every == 0 or step == schedule.steps:
            last = _save(out, step, model, optimizer, corpus, shape, schedule, seen, lengths, loss_sum / loss_count)
            loss_sum, loss_count = 0.0, 0
    bar.close()
    return last


def answer_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the answers only (the next token's label at each position)."""
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=IGNORE)


def checkpoints(out: Path) -> list[Path]:
    """The saved checkpoints of a run, by step."""
    found = [p for p in out.glob("step_*") if (p / STATE).exists()]
    return sorted(found, key=lambda p: int(p.name.removeprefix("step_")))


def latest(out: Path) -> Path | None:
    found = checkpoints(out)
    return found[-1] if found else None


def state_of(checkpoint: Path) -> dict:
    """A checkpoint's ``state.json``."""
    return json.loads((checkpoint / STATE).read_text(encoding="utf-8"))


def load(checkpoint: Path):
    """A checkpoint's model (eval mode, SDPA attention) and its ``state.json``."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(checkpoint, use_safetensors=True, attn_implementation="sdpa").eval()
    return model, state_of(checkpoint)


def _save(out, step, model, optimizer, corpus, shape, schedule, seen, lengths, loss) -> Path:
    """Write ``step_N/`` whole under a temporary name, then rename it: a checkpoint is complete or absent."""
    final, partial = out / f"step_{step}", out / f".step_{step}.partial"
    model.save_pretrained(partial, safe_serialization=True)
    save_file(_optimizer_tensors(model, optimizer), partial / OPTIMIZER)
    histogram = np.bincount(np.asarray(lengths, dtype=np.int64), minlength=corpus.window + 1)
    state = {
        "step": step,
        "tokens_seen": seen,
        "loss": loss,
        "corpus": asdict(corpus),
        "shape": asdict(shape),
        "schedule": asdict(schedule),
        "document_lengths": histogram.tolist(),
    }
    (partial / STATE).write_text(json.dumps(state), encoding="utf-8")
    partial.rename(final)
    return final


def _optimizer_tensors(model, optimizer) -> dict[str, torch.Tensor]:
    tensors = {}
    for name, parameter in model.named_parameters():
        state = optimizer.state.get(parameter, {})
        for moment in ("exp_avg", "exp_avg_sq"):
            if moment in state:
                tensors[f"{name}.{moment}"] = state[moment].contiguous()
        if "step" in state:
            tensors[f"{name}.step"] = torch.as_tensor(state["step"], dtype=torch.float32).reshape(1)
    return tensors


def _resume(checkpoint, model, optimizer, corpus, shape, schedule):
    saved = state_of(checkpoint)
    _check_same_run(checkpoint.parent, saved, corpus, shape, schedule)
    from safetensors.torch import load_model

    load_model(model, checkpoint / "model.safetensors", strict=False)
    moments = load_file(checkpoint / OPTIMIZER)
    for name, parameter in model.named_parameters():
        if f"{name}.exp_avg" in moments:
            optimizer.state[parameter] = {
                "step": moments[f"{name}.step"][0].clone(),
                "exp_avg": moments[f"{name}.exp_avg"],
                "exp_avg_sq": moments[f"{name}.exp_avg_sq"],
            }
    lengths = np.repeat(np.arange(len(saved["document_lengths"])), saved["document_lengths"]).tolist()
    return saved["step"], saved["tokens_seen"], lengths


def _check_same_run(run: Path, saved: dict, corpus: Corpus, shape: Shape, schedule: Schedule) -> None:
    """A resumed run must be the run a straight one would be: the same corpus, model and schedule. Only how often it
    saves may change. (The learning rate at every step depends on ``steps`` and ``warmup``: a run of 8 steps
    resumed to 12 is not a 12-step run.)"""
    given = {"corpus": asdict(corpus), "shape": asdict(shape), "schedule": asdict(schedule)}
    changed = [
        f"{name}={value!r} (the run's: {saved[part].get(name)!r})"
        for part, values in given.items()
        for name, value in values.items()
        if name != "save_every" and saved[part].get(name) != value
    ]
    if changed:
        raise ValueError(
            f"{run} holds a run with other settings: {', '.join(changed)}; resume it with its own settings "
            "(a resumed run must equal a straight one), or give another --out"
        )


def position_frequency(state: dict) -> np.ndarray:
    """``f(i)`` of the documents a checkpoint was trained on (``longreach.analysis.frequency``, one document per
    sequence): the distances inside documents, where records and their queries sit, also when ``concat`` packs
    several documents into a row."""
    histogram = np.asarray(state["document_lengths"])
    lengths = np.repeat(np.arange(len(histogram)), histogram)
    return frequency(lengths, state["corpus"]["window"], "natural")

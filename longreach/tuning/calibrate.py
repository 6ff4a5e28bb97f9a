"""``longreach calibrate dpe``: DPE's two measurements on a model (Lu et al. 2025, arXiv:2504.18857, Sec. 3;
LuLuLuyi/DPE ``dimension_selection/`` and ``effective_length_detection/``), both resumable.

1. Pair importance: for each length ``2048, 4096, ...`` up to ``L`` and each sample ``s``, the essays
   from sentence ``100 s`` on, cut to that many tokens, one prefill; per layer, query head and rotary
   pair the mean over tokens of ``|q_p| |k_p|``; averaged over lengths and samples. Written as
   ``dimensions.safetensors`` (``importance [layers, heads, pairs]``), the ``dimensions`` DPE takes.
2. Group scales: for each frequency group in turn, its scale swept over ``1, 2, 4, ..., target / 1024``
   with every other group at ``max(1, 2 target / L)`` (the official script's ``TEST_MAX_LENGTH /
   PRETRAIN_LENGTH * 2``), scoring a 4-needle probe at the target length; each group keeps its best
   scale (ties: the scale the other groups were held at -- the setting every sweep was measured in --
   else the smaller; the official script leaves ties to the reader). The sweeps are independent, as the
   official script's; the combination is then run on the same cases beside ``rope``, so the report
   says whether it helps.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from ..eval import haystack, runner
from ..eval.distributed import World
from ..eval.engines.transformers import Transformers
from ..eval.grid import Grid, check_lengths
from ..eval.report import cells as report_cells
from ..methods.spec import MethodSpec
from . import tune

# 4 values for one key, fraction found: the needles of DPE's own generator, the length filled
PROBE = "ruler-tight:niah_multivalue"
GROUPS = 8
SAMPLE_STRIDE = 100  # sample s starts at essay sentence 100 s, as the official sampling script


def importance_lengths(window: int) -> list[int]:
    """``2048, 4096, ...`` up to ``L`` (the official list for an 8K model: 2048, 4096, 8192); ``[L]`` below 2048."""
    lengths, n = [], 2048
    while n <= window:
        lengths.append(n)
        n *= 2
    return lengths or [window]


def sweep_values(target: int) -> list[int]:
    """``1, 2, 4, ..., target // 1024`` (the official ``TEST_MAX_LENGTH / length`` for lengths down to 1024)."""
    values, value = [1], 2
    while value <= target // 1024:
        values.append(value)
        value *= 2
    return values


def fixed_scale(target: int, window: int) -> int:
    """The other groups' scale during a sweep: ``2 target / L`` as the official script (at least 1)."""
    return max(1, (target // window) * 2)


@torch.no_grad()
def measure_importance(model, tokenizer, out: Path, lengths: list[int], samples: int, text: str | None = None) -> Path:
    """Pair importance on essays (see the module); each (length, sample) is saved when done, so a rerun resumes.
    Returns ``out/dimensions.safetensors``."""
    from ..integrations.recording import pair_importance
    from ..integrations.transformers import apply, describe, remove

    parts = out / "importance"
    parts.mkdir(parents=True, exist_ok=True)
    sentences = (text or haystack.essays()).split(".")
    todo = [(n, s) for n in lengths for s in range(samples) if not (parts / f"{n}_{s}.safetensors").exists()]
    applied = describe(model)
    apply(model, "rope")  # the stock positions, through longreach's attention (where the probe sits)
    device = next(model.parameters()).device
    try:
        for length, sample in tqdm(todo, desc="pair importance", unit="prefill"):
            ids = tokenizer(
                ".".join(sentences[sample * SAMPLE_STRIDE :]), return_tensors="pt", truncation=True, max_length=length
            ).input_ids
            if ids.shape[1] < length:
                raise ValueError(f"the text has too few tokens for sample {sample} at {length}: {ids.shape[1]}")
            with pair_importance() as record:
                model(ids.to(device), use_cache=False, logits_to_keep=1)
            save_file(
                {"importance": torch.stack([record[layer][0] for layer in sorted(record)])},
                str(parts / f"{length}_{sample}.safetensors"),
            )
    finally:
        if applied == "rope":
            remove(model)
    stacked = torch.stack(
        [load_file(str(parts / f"{n}_{s}.safetensors"))["importance"] for n in lengths for s in range(samples)]
    )
    path = (out / "dimensions.safetensors").resolve()  # the apply line names it from anywhere
    save_file(
        {"importance": stacked.mean(0)},
        str(path),
        metadata={"lengths": ",".join(map(str, lengths)), "samples": str(samples)},
    )
    return path


def _params(scales: list[int], local_window: int, top_k: int | None, dimensions: Path | None) -> dict:
    params = {"group_scales": tuple(scales), "local_window": local_window, "top_k": top_k}
    if dimensions is not None:
        params["dimensions"] = str(dimensions)
    return params


def _spec(scales: list[int], local_window: int, top_k: int | None, dimensions: Path | None) -> MethodSpec:
    return MethodSpec("dpe", tuple(sorted(_params(scales, local_window, top_k, dimensions).items())))


def calibrate(
    model_name: str,
    target: int,
    out: Path,
    samples: int,
    local_window: int = 1024,
    top_k: int | None = None,
    importance_samples: int = 10,
    task: str = PROBE,
    groups: int = GROUPS,
    training_window: int | None = None,
    batch_size: int = 1,
    loaded=None,
) -> dict:
    """DPE's two measurements and a check of their combination (``longreach calibrate dpe``).

    Measures each rotary pair's importance, sweeps each frequency group's scale, then runs the
    combination beside ``rope`` on the same cases. Resumable; writes ``calibration.{md,json,png}`` and
    ``dimensions.safetensors`` in ``out``.

    Args:
        model_name: ``default``, a local folder or a hub id.
        target: the length to calibrate for, in tokens.
        out: the results folder.
        samples: cases per swept setting.
        local_window: DPE's ``w``.
        top_k: pairs changed per head; default three quarters of the rotary pairs (the paper's 48 of
            64); 0 changes every pair and skips the importance measurement.
        importance_samples: texts per length for the importance measurement.
        task: the probe each setting is scored on.
        groups: frequency groups.
        training_window: ``L``; default the model's.
        batch_size: cases decoded together.
        loaded: a ``(model, tokenizer)`` already loaded.

    Returns:
        The calibration: the chosen scales, ``top_k``, the sweeps and the combination's paired
        difference from ``rope``.
    """
    from longreach.attention.rotary import rotary_pairs
    from longreach.integrations.rotary_embedding import find_rotary

    from .. import models
    from ..integrations.transformers import training_window as window_of

    model, tokenizer = loaded or models.load(
        model_name, device=World.from_environment().device()
    )  # a GPU when there is one
    window = training_window or window_of(model.config)
    check_lengths([target], window)
    pairs = rotary_pairs(find_rotary(model))
    if pairs % groups:
        raise ValueError(f"--groups={groups} does not split this model's {pairs} rotary pairs evenly")
    top_k = 3 * pairs // 4 if top_k is None else top_k
    if not 0 <= top_k <= pairs:
        raise ValueError(f"--top-k={top_k} is out of range: 0 (every pair) .. {pairs} (this model's rotary pairs)")
    out.mkdir(parents=True, exist_ok=True)
    dimensions = None
    if top_k:
        dimensions = measure_importance(model, tokenizer, out, importance_lengths(window), importance_samples)
    chosen_top_k = top_k or None
    values, others = sweep_values(target), fixed_scale(target, window)
    sweep = {
        g: [
            _spec([v if h == g else others for h in range(groups)], local_window, chosen_top_k, dimensions)
            for v in values
        ]
        for g in range(groups)
    }
    specs = list({spec.label: spec for group in sweep.values() for spec in group}.values())
    print(
        f"group scale sweep: {groups} groups x scales {values} (others at {others}), {len(specs)} settings x "
        f"{samples} cases of {task} at {target} tokens"
    )
    grid = Grid(model_name, [task], specs, [target], [0.5], samples, training_window)
    runner.run(grid, out, Transformers((model, tokenizer)), batch_size=batch_size)
    by_label = {row.label: row for row in tune.rows(out, specs, task, target)}
    best = {}
    for g, group in sweep.items():
        # ties: the scale every other group was held at (the setting each sweep was measured in), else the smaller
        scored = [
            (by_label[spec.label].score, value == others, -value, value)
            for value, spec in zip(values, group, strict=True)
        ]
        best[g] = max(scored)[-1]
    scales = [best[g] for g in range(groups)]
    chosen = _spec(scales, local_window, chosen_top_k, dimensions)
    check = [chosen, MethodSpec("rope")]
    runner.run(
        Grid(model_name, [task], check, [target], [0.5], samples, training_window),
        out,
        Transformers((model, tokenizer)),
        batch_size=batch_size,
    )
    final = tune.rows(out, check, task, target)
    params = _params(scales, local_window, chosen_top_k, dimensions)
    result = {
        "model": model_name,
        "target": target,
        "training_window": window,
        "task": task,
        "samples": samples,
        "local_window": local_window,
        "top_k": chosen_top_k,
        "dimensions": None if dimensions is None else str(dimensions),
        "sweep_values": values,
        "others_at": others,
        "groups": {
            g: [
                {
                    "scale": v,
                    "score": by_label[s.label].score,
                    "interval": list(by_label[s.label].interval),
                    "n": by_label[s.label].n,
                }
                for v, s in zip(values, sweep[g], strict=True)
            ]
            for g in range(groups)
        },
        "group_scales": scales,
        "apply": tune.apply_line("dpe", params),
        "check": [
            {"label": row.label, "score": row.score, "interval": list(row.interval), "n": row.n} for row in final
        ],
        "minus_rope": dict(zip(("difference", "interval", "n"), final[0].minus(final[1]), strict=True)),
    }
    (out / "calibration.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    (out / "calibration.md").write_text(_markdown(result, final), encoding="utf-8")
    from .. import plots

    series = {
        f"group {g} (pairs {g * pairs // groups}-{(g + 1) * pairs // groups - 1})": (
            values,
            [row["score"] for row in result["groups"][g]],
            [tuple(row["interval"]) for row in result["groups"][g]],
        )
        for g in range(groups)
    }
    marks = {name: best[g] for g, name in enumerate(series)}
    plots.sweeps(
        series,
        f"DPE scale sweep: {task} at {target} tokens, others at {others}, n = {samples} per point",
        out / "calibration.png",
        "group scale s_g",
        marks,
    )
    return result


def _markdown(result: dict, final: list) -> str:
    values = result["sweep_values"]
    lines = [
        f"## DPE calibration: {result['model']} at {result['target']} tokens (L = {result['training_window']})",
        "",
        f"Probe: `{result['task']}`, {result['samples']} cases per setting; every other group at scale "
        f"{result['others_at']}; w = {result['local_window']}, top_k = {result['top_k']}.",
        "",
        "| group | " + " | ".join(f"s = {v}" for v in values) + " | best |",
        "|---|" + "---|" * (len(values) + 1),
    ]
    for g, row in result["groups"].items():
        cells = [_cell(c["score"], c["interval"], c["n"]) for c in row]
        lines.append(f"| {g} | " + " | ".join(cells) + f" | {result['group_scales'][int(g)]} |")
    lines += ["", "The combination on the same cases:", "", "| method | score [95% interval] | n |", "|---|---|---|"]
    lines += [f"| `{row.label}` | {_cell(row.score, row.interval, row.n)} | {row.n} |" for row in final]
    combination, rope = final
    lines += [
        "",
        "Paired on the same cases, the calibrated dpe minus rope: "
        f"{report_cells.difference(*combination.minus(rope))}.",
    ]
    lines += ["", f"Apply: `{result['apply']}`", ""]
    return "\n".join(lines)


def _cell(score: float, interval, n: int) -> str:
    return f"{score:.1f} {report_cells.bounds(tuple(interval))}" if n else "—"

"""What long context costs (long-context primer): attention FLOPs and KV-cache memory, from a config.

Per layer and head, attention is two matrix products (``Q K^T`` and ``P V``) of ``2 * head_dim``
FLOPs per attended (query, key) pair, so attention FLOPs = ``4 * head_dim * heads * layers * pairs``
with ``pairs`` = ``n^2`` (full), ``n(n+1)/2`` (causal) or ``sum_i min(i+1, w)`` (sliding window w).
The KV cache holds keys and values of every layer: ``2 * layers * kv_heads * head_dim * n * bytes``
(so grouped-query attention counts). Weights are counted exactly on the meta device (no memory,
no download).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

DEVICES_GIB = (
    24,
    80,
    140,
)  # GPU memory as nvidia-smi reports it, rounded to GiB: a "24 GB" card, an 80 GB A100/H100, a 141 GB H200
GIB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8": 1}


@dataclass(frozen=True)
class Shape:
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    parameters: int
    name: str = ""


def shape_of(config) -> Shape:
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return Shape(
        config.num_hidden_layers,
        heads,
        getattr(config, "num_key_value_heads", None) or heads,
        head_dim,
        count_parameters(config),
        Path(str(getattr(config, "_name_or_path", "") or "")).name or config.model_type,
    )


def count_parameters(config) -> int:
    """Exact parameter count: the model built on the meta device (no memory is allocated)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config))
    return sum(p.numel() for p in model.parameters())


def attention_pairs(n: int, mode: str, window: int | None = None) -> int:
    """Attended (query, key) pairs for ``n`` tokens: ``full``, ``causal`` or ``sliding`` (window ``w``)."""
    if mode == "full":
        return n * n
    if mode == "causal":
        return n * (n + 1) // 2
    if mode == "sliding":
        if not window or window < 1:
            raise ValueError(f"window={window!r} is out of range: sliding attention needs a window >= 1")
        w = min(window, n)
        return w * (w + 1) // 2 + (n - w) * w
    raise ValueError(f"mode={mode!r} is not one of: full, causal, sliding")


def attention_flops(shape: Shape, n: int, mode: str, window: int | None = None) -> int:
    return 4 * shape.head_dim * shape.heads * shape.layers * attention_pairs(n, mode, window)


def kv_cache_bytes(shape: Shape, n: int, dtype_bytes: int = 2) -> int:
    return 2 * shape.layers * shape.kv_heads * shape.head_dim * n * dtype_bytes


def table(shape: Shape, lengths: list[int], dtype_bytes: int = 2, window: int = 4096) -> list[dict]:
    """Attention FLOPs, KV-cache and weight bytes per length (``longreach cost``).

    Args:
        shape: the model's shape (``shape_of(config)``; built on the meta device, nothing downloaded).
        lengths: lengths in tokens.
        dtype_bytes: bytes per weight and cache element.
        window: the sliding window of the ``sliding`` row.

    Returns:
        One dict per length: ``tokens``, ``full_flops``, ``causal_flops``, ``sliding_flops``,
        ``kv_bytes``, ``weight_bytes`` and whether weights and cache fit in 24, 80 and 140 GiB.
    """
    weights = shape.parameters * dtype_bytes
    rows = []
    for n in lengths:
        kv = kv_cache_bytes(shape, n, dtype_bytes)
        rows.append(
            {
                "tokens": n,
                "full_flops": attention_flops(shape, n, "full"),
                "causal_flops": attention_flops(shape, n, "causal"),
                "sliding_flops": attention_flops(shape, n, "sliding", window),
                "kv_bytes": kv,
                "weight_bytes": weights,
                **{f"fits_{gib}GiB": weights + kv <= gib * GIB for gib in DEVICES_GIB},
            }
        )
    return rows


def markdown(rows: list[dict], window: int) -> str:
    from ..plots import length_text

    fits = " | ".join(f"fits {gib} GiB" for gib in DEVICES_GIB)
    lines = [
        f"| tokens (K = 1024) | attention FLOPs (full) | causal | sliding w={window} | KV cache | weights | {fits} |",
        "|---" * (6 + len(DEVICES_GIB)) + "|",
    ]
    for r in rows:
        marks = " | ".join("yes" if r[f"fits_{gib}GiB"] else "no" for gib in DEVICES_GIB)
        lines.append(
            f"| {length_text(r['tokens'])} | {r['full_flops']:.3g} | {r['causal_flops']:.3g} | "
            f"{r['sliding_flops']:.3g} | "
            f"{_gib(r['kv_bytes'])} | {_gib(r['weight_bytes'])} | {marks} |"
        )
    return "\n".join(lines)


def _gib(n: int) -> str:
    """Bytes in GiB, the plot's unit too: three significant digits, whole GiB from 1,000 up."""
    gib = n / GIB
    return f"{gib:,.0f} GiB" if gib >= 1000 else f"{gib:.3g} GiB"


def plot(shape: Shape, lengths: list[int], path: Path, dtype_bytes: int = 2, window: int = 4096) -> Path:
    """Log-log: quadratic attention compute vs sliding-window compute (left), linear KV memory (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib import ticker

    from ..plots import length_text

    n = np.unique(np.geomspace(min(lengths), max(lengths), 60).astype(int))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for mode, label in (
        ("full", "full attention"),
        ("causal", "causal attention"),
        ("sliding", f"sliding window {window}"),
    ):
        left.loglog(n, [attention_flops(shape, int(x), mode, window) for x in n], label=label)
    left.set(
        xlabel="context length (tokens)",
        ylabel="attention FLOPs per forward pass",
        title="compute: quadratic vs sliding window",
    )
    right.loglog(n, [kv_cache_bytes(shape, int(x), dtype_bytes) / GIB for x in n], label="KV cache")
    right.axhline(shape.parameters * dtype_bytes / GIB, color="grey", linestyle="--", label="weights")
    for gib in DEVICES_GIB:
        right.axhline(gib, color="black", linestyle=":", linewidth=0.8)
        right.text(n[0], gib, f" {gib} GiB", va="bottom", fontsize=7)
    right.set(
        xlabel="context length (tokens)",
        ylabel="memory (GiB)",
        title=f"memory: linear KV cache ({dtype_bytes}-byte values)",
    )
    for ax in (left, right):
        ax.set_xticks(lengths, [length_text(x) for x in lengths])  # the table's lengths, as it writes them
        ax.xaxis.set_minor_formatter(ticker.NullFormatter())
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.suptitle(shape.name)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def load_config(source: str):
    """A config from a bundled model or a ``.gguf`` file (converted once), a ``config.json`` file, a local folder or a
    hub id; never weights."""
    from transformers import AutoConfig

    from ..gguf_models import converts, path_of

    if converts(source):  # a bundled model, or a .gguf file
        return AutoConfig.from_pretrained(path_of(source))
    path = Path(source)
    if path.is_file():
        return AutoConfig.from_pretrained(path.parent) if path.name == "config.json" else _from_json(path)
    try:
        return AutoConfig.from_pretrained(source)
    except OSError:
        raise RuntimeError(
            f"cannot read a config from {source!r}: not a file, a folder with config.json, or a reachable hub id"
        ) from None


def _from_json(path: Path):
    import json

    from transformers import AutoConfig

    try:
        data = json.loads(path.read_text(encoding="utf-8", errors="replace"))
    except json.JSONDecodeError as error:
        raise ValueError(f"--model={path} is not a model config: not JSON ({error.msg}, line {error.lineno})") from None
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise ValueError(f"--model={path} is not a model config: it names no model_type")
    try:
        return AutoConfig.for_model(data.pop("model_type"), **data)
    except (ValueError, KeyError) as error:
        raise ValueError(f"--model={path} is not a config transformers knows ({error})") from None

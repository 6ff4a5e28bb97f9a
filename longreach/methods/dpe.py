"""DPE: dimension-wise positional embeddings manipulation (Lu et al. 2025, "Effective Length
Extrapolation via Dimension-Wise Positional Embeddings Manipulation", arXiv:2504.18857, COLM 2025).

RoPE's rotary pairs (``inv_freq``, highest frequency first) form ``G`` equal groups; group ``g`` has an
integer scale ``s_g``. In each layer and head, the ``top_k`` pairs of largest importance (mean over
tokens of ``|q_p| |k_p|``, the pairs' 2-D norms, measured by ``longreach calibrate dpe``) see
Self-Extend's grouped position with their group's scale; every other pair sees ``r = i - j``::

    P_g(i, j) = r                                   if r < w
              = i // s_g - j // s_g + w - w // s_g  otherwise

Two parts, as Self-Extend: the band ``r < w`` at the original positions, and the far pairs with the
query of group ``g`` at ``i // s_g + w - w // s_g`` and the key at ``j // s_g`` -- in the marked pairs only.
The official code (LuLuLuyi/DPE ``dpe_for_llama.py``) computes ``w - w / s_g`` with a float division in
prefill and ``//`` in decoding; they agree when ``s_g`` divides ``w`` (its published settings); this
follows ``//`` everywhere.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import torch

from .base import Part, PositionMethod, causal_distance, require_int

PUBLISHED = {  # LuLuLuyi/DPE config/dpe_config.yaml: w = 1024, top_k = 48 of 64 pairs
    "Llama-3-8B-Instruct": (4, 4, 2, 16, 32, 32, 16, 128),
    "Llama-3.1-8B-Instruct": (2, 32, 32, 2, 2, 2, 2, 1),
    "Qwen2.5-7B-Instruct": (2, 16, 8, 8, 32, 8, 2, 4),
    "Mistral-7B-Instruct-v0.2": (4, 16, 2, 16, 32, 16, 16, 2),
}


def saved_selection(mask: torch.Tensor, source) -> dict:
    """A boolean selection as JSON for a saved model's config: its shape, its bits (packed, base64), their
    SHA-256, and the name of the file it was chosen from (``None`` for a tensor), which ``describe`` shows."""
    bits = np.packbits(mask.numpy().reshape(-1))
    return {
        "file": _source_name(source),
        "shape": list(mask.shape),
        "selected": base64.b64encode(bits.tobytes()).decode(),
        "sha256": _digest(mask),
    }


def _from_saved(saved: dict) -> torch.Tensor:
    """The boolean mask of :func:`saved_selection`; a selection whose bits do not match their digest is refused."""
    try:
        shape = [int(n) for n in saved["shape"]]
        bits = np.unpackbits(np.frombuffer(base64.b64decode(saved["selected"], validate=True), dtype=np.uint8))
        mask = torch.from_numpy(bits[: math.prod(shape)].astype(bool).reshape(shape))
    except (KeyError, TypeError, ValueError, binascii.Error) as error:
        raise ValueError(
            f"dimensions: the saved selection is malformed ({error.__class__.__name__}: {error}); "
            "apply dpe again with the file from `longreach calibrate dpe`"
        ) from None
    if _digest(mask) != saved.get("sha256"):
        raise ValueError(
            "dimensions: the saved selection does not match its sha256 (config.json was edited); "
            "apply dpe again with the file from `longreach calibrate dpe`"
        )
    return mask


def _digest(mask: torch.Tensor) -> str:
    return hashlib.sha256(mask.numpy().tobytes()).hexdigest()


def _source_name(source) -> str | None:
    if isinstance(source, (str, Path)):
        return Path(str(source)).name
    return source.get("file") if isinstance(source, dict) else None


def load_dimensions(source) -> torch.Tensor:
    """A ``[layers, heads, pairs]`` tensor: boolean (the pairs to change) or real (their importance), from a
    tensor, nested lists, a safetensors file written by ``longreach calibrate dpe`` (``importance`` or
    ``mask``), or the selection a saved model keeps in its config (:func:`saved_selection`)."""
    if isinstance(source, dict):
        return _from_saved(source)
    if isinstance(source, (str, Path)):
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        if not Path(source).is_file():
            raise ValueError(
                f"dimensions={str(source)!r} is not a file: give a file written by `longreach calibrate dpe`"
            )
        try:
            tensors = load_file(str(source))
        except (SafetensorError, OSError) as error:
            raise ValueError(f"dimensions={str(source)!r} is not a safetensors file ({error})") from None
        name = next((n for n in ("mask", "importance") if n in tensors), None)
        if name is None:
            raise ValueError(
                f"dimensions={str(source)!r} holds {', '.join(tensors) or 'nothing'}; expected 'importance' or 'mask'"
            )
        source = tensors[name]
    tensor = torch.as_tensor(source).detach().cpu()
    if tensor.dim() != 3 or tensor.numel() == 0:
        raise ValueError(f"dimensions must be a [layers, heads, pairs] tensor, got shape {tuple(tensor.shape)}")
    if tensor.dtype != torch.bool and not (tensor.is_floating_point() and bool(torch.isfinite(tensor).all())):
        raise ValueError(f"dimensions must be boolean (pairs to change) or finite real importances, got {tensor.dtype}")
    return tensor


@dataclass(frozen=True, eq=False)
class DPE(PositionMethod):
    """DPE (Lu et al. 2025): Self-Extend per frequency group, in each head's most important rotary pairs.

    Args:
        training_window: the model's ``L``.
        group_scales: ``s_g``, one integer >= 1 per frequency group (required; ``longreach calibrate
            dpe`` finds them, ``longreach.methods.dpe.PUBLISHED`` has the paper's).
        local_window: ``w``, an integer > 0.
        top_k: how many pairs change per layer and head, the most important first (the paper: 48 of
            64); ``None`` changes every pair and needs no ``dimensions``.
        dimensions: the pairs' importances: a ``dimensions.safetensors`` written by ``longreach
            calibrate dpe``, or a ``[layers, query heads, pairs]`` tensor of importances or a boolean mask.
    """

    name = "dpe"
    paper = "Lu et al. 2025, Dimension-Wise Positional Embeddings Manipulation, DPE (arXiv:2504.18857)"
    changes = (
        "positions per frequency group and head: P_g = r for r < w, else i//s_g - j//s_g + w - w//s_g "
        "in the top_k pairs"
    )
    ranges = {
        "group_scales": "integers >= 1, one per frequency group (e.g. 8; required: `longreach calibrate dpe`)",
        "local_window": "integer > 0",
        "top_k": "integer 1 .. rotary pairs, or None (every pair)",
        "dimensions": "a file from `longreach calibrate dpe`, or a [layers, heads, pairs] tensor",
    }

    training_window: int
    group_scales: tuple[int, ...] | None = None
    local_window: int = 1024
    top_k: int | None = 48
    dimensions: object = None

    def __post_init__(self) -> None:
        # derived here, not dataclass fields (nor parameters): set with object.__setattr__ (frozen), typed for mypy
        self._mask: torch.Tensor | None  # [layers, heads, pairs]: the pairs that change; None: every pair
        self._layer_parts: dict[int | None, tuple[Part, ...]]
        self._query_shift: Callable[[torch.Tensor], torch.Tensor]
        self._key_shift: Callable[[torch.Tensor], torch.Tensor]
        if self.group_scales is None:
            published = "; ".join(f"{k}: {','.join(map(str, v))}" for k, v in PUBLISHED.items())
            raise ValueError(
                "dpe needs group_scales (one integer per frequency group): `longreach calibrate dpe` finds them "
                f"for a model; published (w=1024, top_k=48): {published}"
            )
        scales = self.group_scales if isinstance(self.group_scales, (tuple, list)) else (self.group_scales,)
        if not scales:
            raise ValueError("group_scales=() is out of range: integers >= 1, one per frequency group (at least one)")
        for value in scales:
            require_int("group_scales", value, 1, None, "integers >= 1, one per frequency group")
        object.__setattr__(self, "group_scales", tuple(int(s) for s in scales))
        require_int("local_window", self.local_window, 1, None, "local_window > 0")
        if self.top_k is not None:
            require_int(
                "top_k", self.top_k, 1, None, "an integer >= 1 (rotary pairs changed per head), or None for every pair"
            )
        mask = None
        if self.dimensions is not None:
            mask = _selected(
                load_dimensions(self.dimensions), self.top_k
            ).cpu()  # on the CPU: reading it per layer syncs no device
        elif self.top_k is not None:
            raise ValueError(
                f"top_k={self.top_k} changes the most important pairs, which needs dimensions= (a file written by "
                "`longreach calibrate dpe`); give top_k=None to change every pair"
            )
        object.__setattr__(self, "_mask", mask)
        object.__setattr__(self, "_layer_parts", {})
        scale = torch.tensor(self.group_scales, dtype=torch.float64)
        w = self.local_window
        offset = w - torch.div(torch.tensor(float(w)), scale, rounding_mode="floor")

        def grouped(p: torch.Tensor) -> torch.Tensor:  # [B, L] -> [B, L, G]: floor(p / s_g)
            return torch.div(p[..., None], scale.to(p.device), rounding_mode="floor")

        object.__setattr__(self, "_query_shift", lambda p: grouped(p) + offset.to(p.device) - p[..., None])
        object.__setattr__(self, "_key_shift", lambda p: grouped(p) - p[..., None])

    def check_model(self, layers: int, query_heads: int, pairs: int) -> None:
        assert self.group_scales is not None  # set in __post_init__
        groups = len(self.group_scales)
        if pairs % groups:
            raise ValueError(
                f"group_scales has {groups} groups, which do not split this model's {pairs} rotary pairs evenly"
            )
        if self._mask is None:
            return
        expected = (layers, query_heads, pairs)
        if tuple(self._mask.shape) != expected:
            raise ValueError(
                f"dimensions has shape {tuple(self._mask.shape)}; this model needs [layers, query heads, pairs] = "
                f"{list(expected)} (calibrate it on this model)"
            )

    def parts(self) -> tuple[Part, ...]:
        return self.layer_parts(None)

    @property
    def parts_differ_by_layer(self) -> bool:
        return self._mask is not None

    def layer_parts(self, layer: int | None) -> tuple[Part, ...]:
        if self._mask is not None and layer is None:
            raise ValueError("dpe with selected dimensions has parts per layer: use layer_parts(layer)")
        if layer not in self._layer_parts:
            pairs = None if self._mask is None else self._mask[layer]
            self._layer_parts[layer] = (
                Part(0, self.local_window),
                Part(self.local_window, None, query_shift=self._query_shift, key_shift=self._key_shift, pairs=pairs),
            )
        return self._layer_parts[layer]

    def relative_positions(self, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
        """Every pair changed (``P [..., Lq, Lkv, G]``, one position per frequency group)."""
        w = self.local_window
        d = causal_distance(query_positions, key_positions)[..., None]
        scale = torch.tensor(self.group_scales, dtype=torch.float64, device=d.device)
        i, j = query_positions[..., None].to(torch.float64), key_positions[..., None].to(torch.float64)
        grouped = torch.floor(i / scale) - torch.floor(j / scale) + w - torch.floor(w / scale)
        return torch.where(d < w, d, d * 0 + grouped)  # d * 0 keeps NaN (not attended)

    def layer_positions(
        self, query_positions: torch.Tensor, key_positions: torch.Tensor, layer: int | None
    ) -> torch.Tensor:
        """``[B, H, Lq, Lkv, pairs]``: each head's selected pairs at their group's position, the others at ``r``."""
        grouped = self.relative_positions(query_positions, key_positions)  # [B, Lq, Lkv, G]
        if self._mask is None:
            return grouped[:, None]
        mask = self._mask[layer].to(grouped.device)  # [H, P]
        per_pair = grouped.repeat_interleave(mask.shape[-1] // grouped.shape[-1], dim=-1)[:, None]  # [B, 1, Lq, Lkv, P]
        r = causal_distance(query_positions, key_positions)[:, None, ..., None]
        return torch.where(mask[None, :, None, None, :], per_pair, r)

    def saved_params(self) -> dict:
        """The selected pairs themselves, not the file they came from: a saved model carries its calibration."""
        params = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "training_window"}
        if self._mask is not None:
            params["dimensions"] = saved_selection(self._mask, self.dimensions)
        return params

    def describe(self) -> str:
        assert self.group_scales is not None  # set in __post_init__
        values = [
            f"group_scales={','.join(map(str, self.group_scales))}",
            f"local_window={self.local_window}",
            f"top_k={self.top_k}",
        ]
        if self._mask is not None:
            values.append(f"dimensions={_source_name(self.dimensions) or 'tensor'}@{_digest(self._mask)[:8]}")
        return f"{self.name}({', '.join(values)})"


def _selected(dimensions: torch.Tensor, top_k: int | None) -> torch.Tensor:
    """The boolean ``[layers, heads, pairs]`` mask: given, or the ``top_k`` largest importances per layer and head."""
    pairs = dimensions.shape[-1]
    if dimensions.dtype == torch.bool:
        counts = dimensions.sum(-1)
        if top_k is not None and not bool((counts == top_k).all()):
            raise ValueError(
                f"dimensions is a mask with {int(counts.min())}..{int(counts.max())} pairs per head, "
                f"not top_k={top_k}: give top_k=None to use the mask as it is"
            )
        return dimensions
    if top_k is None:
        return torch.ones(dimensions.shape, dtype=torch.bool)
    if top_k > pairs:
        raise ValueError(
            f"top_k={top_k} is out of range: 1 .. {pairs} (the rotary pairs in dimensions; "
            f"the paper changes 48 of 64, i.e. {3 * pairs // 4} here)"
        )
    chosen = dimensions.topk(top_k, dim=-1).indices
    return torch.zeros(dimensions.shape, dtype=torch.bool).scatter_(-1, chosen, True)

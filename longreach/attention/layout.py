"""One attention layer's rotary layout: whether it rotates, which dimensions, and how they pair.

RoPE (Su et al. 2021, RoFormer, Eq. 34) turns each pair of a head's dimensions by ``position * inv_freq[k]``. Models
lay the pairs out differently:

- ``half``: the pair ``k`` is ``(x_k, x_{k + R/2})``, transformers' ``rotate_half`` (Llama, Qwen, Mistral, Gemma);
- ``interleaved``: the pair ``k`` is ``(x_{2k}, x_{2k+1})``, RoFormer's own (GLM-4, ERNIE 4.5, Cohere, Llama 4);
- over the first ``R`` of ``D`` dimensions (partial rotary: Phi-3, GLM-4), or the last ``R`` (multi-head latent
  attention: DeepSeek-V3's ``qk_rope_head_dim`` after its ``qk_nope_head_dim``);
- or not at all: a layer without RoPE (NoPE: SmolLM3's ``no_rope_layers``, Cohere2's and EXAONE 4's global layers).

The kernels compute one layout, ``half`` over the first ``R`` dimensions. Attention depends on queries and keys only
through their dot products, which a permutation of a head's dimensions applied to both leaves unchanged, so a layer
of any other layout is attended exactly by permuting its queries and keys into that one (:meth:`Layout.order`); its
values, and so its output, are untouched.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

PAIRINGS = ("half", "interleaved")


@dataclass(frozen=True)
class Layout:
    """How one attention layer applies RoPE to its queries and keys of ``head_dim`` dimensions.

    ``rotated``: False for a layer without RoPE (it stays exactly stock under every method). ``pairs``: ``half`` or
    ``interleaved``. ``start``: the first rotated dimension (0, or ``head_dim - dims`` where the last dimensions
    rotate). ``dims``: how many dimensions rotate, twice the frequencies. ``layer_type``: which frequencies of the
    rotary module the layer turns by (one per layer type on Gemma 3; None: the module's only ones).
    """

    rotated: bool
    head_dim: int
    pairs: str = "half"
    start: int = 0
    dims: int = 0
    layer_type: str | None = None

    def __post_init__(self) -> None:
        if self.pairs not in PAIRINGS:
            raise ValueError(f"pairs={self.pairs!r} must be one of {', '.join(PAIRINGS)}")
        if self.rotated and not (0 < self.dims <= self.head_dim and self.dims % 2 == 0):
            raise ValueError(f"dims={self.dims} must be even and within the head's {self.head_dim} dimensions")
        if self.rotated and not 0 <= self.start <= self.head_dim - self.dims:
            raise ValueError(f"start={self.start}: {self.dims} rotated dimensions do not fit a head of {self.head_dim}")

    @property
    def kernel_ready(self) -> bool:
        """Whether the kernels take this layer's queries and keys as they are: ``half`` pairs over the first
        dimensions (a layer without RoPE never reaches them with a shift)."""
        return not self.rotated or (self.pairs == "half" and self.start == 0)

    def pair_indices(self) -> tuple[list[int], list[int]]:
        """``(a, b)``: the head dimensions of each rotary pair ``k``, turned as ``(x_a cos - x_b sin, x_b cos + x_a
        sin)`` by the angle ``position * inv_freq[k]``."""
        half = self.dims // 2
        if self.pairs == "half":
            first = [self.start + k for k in range(half)]
            return first, [i + half for i in first]
        return [self.start + 2 * k for k in range(half)], [self.start + 2 * k + 1 for k in range(half)]

    def order(self) -> list[int] | None:
        """The permutation of a head's dimensions that puts this layout's pairs where the kernels read them (pair
        ``k`` at ``(k, k + R/2)``), the other dimensions after them in their order; None where none is needed."""
        if self.kernel_ready:
            return None
        a, b = self.pair_indices()
        rotated = set(a) | set(b)
        return a + b + [i for i in range(self.head_dim) if i not in rotated]

    def describe(self) -> str:
        """e.g. ``"RoPE, interleaved pairs, dims 0-63 of 128"`` or ``"no RoPE"``."""
        if not self.rotated:
            return "no RoPE"
        where = f"dims {self.start}-{self.start + self.dims - 1} of {self.head_dim}"
        return f"RoPE, {self.pairs} pairs, {where}"


def to_kernel(layout: Layout, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tensors [..., head_dim]`` (a layer's queries and keys) with their dimensions in the kernels' order,
    :meth:`Layout.order` (the same tensors where the layout needs none). Written as slices and one transpose, which
    copy at memory speed, where a gather along the last dimension is ten times slower on a CPU."""
    if layout.order() is None:
        return tensors
    return tuple(_in_kernel_order(layout, x) for x in tensors)


def _in_kernel_order(layout: Layout, x: torch.Tensor) -> torch.Tensor:
    end = layout.start + layout.dims
    rotated = x[..., layout.start : end]
    if layout.pairs == "interleaved":  # (x_0, x_1, x_2, x_3, ...) -> (x_0, x_2, ..., x_1, x_3, ...)
        rotated = rotated.unflatten(-1, (layout.dims // 2, 2)).transpose(-1, -2).flatten(-2)
    rest = [part for part in (x[..., : layout.start], x[..., end:]) if part.shape[-1]]
    return torch.cat([rotated, *rest], dim=-1)


def layer_ranges(indices: list[int]) -> str:
    """Layer indices as runs: ``[0, 1, 2, 4]`` -> ``"0-2, 4"``."""
    runs = []
    for _, run in itertools.groupby(enumerate(indices), key=lambda pair: pair[1] - pair[0]):
        values = [value for _, value in run]
        runs.append(str(values[0]) if len(values) == 1 else f"{values[0]}-{values[-1]}")
    return ", ".join(runs)

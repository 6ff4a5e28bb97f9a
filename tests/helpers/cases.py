"""The kernel's reference cases: random q/k/v rotated at padding-aware positions (:func:`case`), the float64 dense
reference's answer (:func:`expected`), the kernel's own on the same inputs (:func:`attend`), and the methods the
backends' tests share (:data:`BASELINES`, :data:`DISTANCE_METHODS`)."""

import torch

from longreach.attention import kernel, reference
from longreach.attention.rotary import rotate


def inv_freq_for(rotary_dims: int) -> torch.Tensor:
    return 1.0 / (10000 ** (torch.arange(0, rotary_dims, 2, dtype=torch.float64) / rotary_dims))


def case(n, batch=2, q_heads=4, kv_heads=2, dim=16, rotary_dims=16, pads=(0, 0), seed=0):
    """Raw q/k/v, their rotated versions at padding-aware positions, and the key padding mask."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, q_heads, n, dim, generator=g, dtype=torch.float64)
    k = torch.randn(batch, kv_heads, n, dim, generator=g, dtype=torch.float64)
    v = torch.randn(batch, kv_heads, n, dim, generator=g, dtype=torch.float64)
    positions = torch.stack([torch.arange(n) - pad for pad in pads])  # left padding: real tokens from 0
    padding = positions >= 0
    inv_freq = inv_freq_for(rotary_dims)

    def rotated(x):
        return rotate(x, positions[:, None, :].double(), inv_freq)

    return q, k, v, rotated(q), rotated(k), positions, padding, inv_freq


def expected(method, q, k, v, positions, padding, inv_freq, q_len, scaling, window=None):
    P = method.layer_positions(positions[:, -q_len:, None], positions[:, None, :], 0)
    if window is not None:
        P = torch.where(positions[:, -q_len:, None] - positions[:, None, :] < window, P, torch.nan)
    out = reference.dense_attention(
        q[:, :, -q_len:], k, v, P, inv_freq, scaling, key_padding=padding, logit_scale=method.logit_scale
    )
    real_rows = padding[:, -q_len:]  # padding query rows are never read
    return out, real_rows


def attend(method, case, q_len=None, dtype=torch.float32, **options) -> torch.Tensor:
    """``kernel.attention`` of ``case``'s last ``q_len`` rotated queries (all of them by default) over its rotated keys
    and values, in ``dtype``; ``method``'s parts of layer 0 (its ``parts()`` but for DPE's per-layer pairs), the
    inverse frequencies in float32 (float64 with float64 inputs) and the method's logit scale. Everything else --
    ``scaling``, ``key_padding``, ``positions``, ``backend``, ``tile``, ``sliding_window``, ``drop``, a
    ``logit_scale`` of its own -- is passed as given."""
    _, _, v, q_rot, k_rot, _, _, inv_freq = case
    q_len = q_rot.shape[2] if q_len is None else q_len
    options.setdefault("logit_scale", method.logit_scale)
    return kernel.attention(
        q_rot[:, :, -q_len:].to(dtype),
        k_rot.to(dtype),
        v.to(dtype),
        method.layer_parts(0),
        inv_freq.to(torch.float64 if dtype == torch.float64 else torch.float32),
        **options,
    )


BASELINES = [
    ("rerope", {"window": 12}),
    ("rerope", {"window": 12, "leak": 4.0}),
    ("self_extend", {"group_size": 3, "neighbor_window": 10}),
    ("dca", {"chunk_size": 16, "local_window": 4}),
    ("dca", {"chunk_size": 9, "local_window": 5}),
    (
        "dpe",
        {"group_scales": (2, 3, 1, 4), "local_window": 10, "top_k": None},
    ),  # every pair: a shift per frequency group
    # per-head pairs that differ inside a key/value group (keys repeated per query head), then agree inside it (not
    # repeated)
    (
        "dpe",
        {
            "group_scales": (2, 3, 1, 4),
            "local_window": 10,
            "top_k": 5,
            "dimensions": torch.rand(1, 4, 8, generator=torch.Generator().manual_seed(3)),
        },
    ),
    (
        "dpe",
        {
            "group_scales": (4, 2),
            "local_window": 7,
            "top_k": None,
            "dimensions": torch.tensor(
                [[1, 0, 1, 1, 0, 0, 1, 0], [0, 1, 1, 0, 1, 1, 0, 0]], dtype=torch.bool
            ).repeat_interleave(2, 0)[None],
        },
    ),
]
"""The methods beside RoPE and STRING: per-token shifts (ReRoPE, Self-Extend), DCA's chunk spans, DPE's pairs."""

DISTANCE_METHODS = [
    ("rope", {}),
    ("string", {"shift": 40, "local_window": 5}),
    ("rerope", {"window": 36}),
    ("rerope", {"window": 36, "leak": 4.0}),
    ("self_extend", {"group_size": 3, "neighbor_window": 34}),
]
"""Methods whose parts are bands of distances (no key spans, no per-head pairs): tests/test_cudnn.py and
tests/test_cuda_flash.py."""

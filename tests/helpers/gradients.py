"""Gradients through the kernel against autograd through the float64 dense reference: the methods and the comparison
of tests/test_gradients.py, which tests/test_cuda.py runs on a GPU."""

import torch

from helpers.cases import case
from longreach.attention import kernel, reference
from longreach.attention.rotary import rotate

METHODS = [
    ("rope", {}),
    ("string", {"shift": 9, "local_window": 2}),
    ("string", {"shift": 9, "local_window": 2, "mscale": True}),
    ("string", {"shift": 38, "local_window": 2}),  # a band wide enough for unmasked blocks, its upper squares flipped
    ("rerope", {"window": 12}),
    ("rerope", {"window": 12, "leak": 3.0}),
    ("self_extend", {"group_size": 3, "neighbor_window": 8}),
    ("dca", {"chunk_size": 16, "local_window": 4}),
    (
        "dpe",
        {
            "group_scales": (2, 3, 1, 4),
            "local_window": 8,
            "top_k": 5,
            "dimensions": torch.rand(1, 4, 8, generator=torch.Generator().manual_seed(3)),
        },
    ),
]


def gradients(method, backend, n, q_len, pads, dtype, tile):
    """Gradients of a random linear loss w.r.t. the raw q, k, v: (kernel's, reference's)."""
    q, k, v, _, _, positions, padding, inv_freq = case(n, pads=pads)
    weight = torch.randn(2, q_len, 4, 16, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    rows = padding[:, -q_len:, None, None]  # padding query rows are never read
    results = []
    for use_kernel in (True, False):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        raw_q, raw_k, raw_v = leaves
        if use_kernel:

            def rotated(x):
                return rotate(x, positions[:, None, :].double(), inv_freq)

            out = kernel.attention(
                rotated(raw_q)[:, :, -q_len:].to(dtype),
                rotated(raw_k).to(dtype),
                raw_v.to(dtype),
                method.layer_parts(0),
                inv_freq.to(dtype),
                scaling=0.3,
                key_padding=padding if pads[1] else None,
                positions=positions,
                backend=backend,
                tile=tile,
                logit_scale=method.logit_scale,
            ).double()
        else:
            P = method.layer_positions(positions[:, -q_len:, None], positions[:, None, :], 0)
            out = reference.dense_attention(
                raw_q[:, :, -q_len:],
                raw_k,
                raw_v,
                P,
                inv_freq,
                0.3,
                key_padding=padding,
                logit_scale=method.logit_scale,
            )
        (out * weight * rows).sum().backward()
        results.append([leaf.grad for leaf in leaves])
    return results

"""Every difference between the PyTorch and transformers releases longreach supports, in one place.

Each helper names the releases on either side of the difference; ``make test-compat`` runs the suite
on the oldest and the newest of them (the table in docs/get-started.md), and ``tests/test_compat.py``
takes each branch on whichever release is installed.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def cpu_flash_takes_grouped_heads() -> bool:
    """Whether PyTorch's CPU flash attention op reads fewer key/value heads than query heads correctly.

    PyTorch 2.7 (and 2.6) accepts such inputs and returns garbage (NaN, or values of 1e30); 2.13 and 2.15 (tested)
    compute grouped-query attention. Probed once on a tiny input rather than read from a version number, as
    the release that changed it is not known here.
    """
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, 4, 8, generator=generator) for heads in (2, 1, 1))
    grouped, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=True)[:2]
    repeated, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k.expand(-1, 2, -1, -1), v.expand(-1, 2, -1, -1), is_causal=True
    )[:2]
    return bool(torch.allclose(grouped, repeated, atol=1e-6))


def flex_attention_with_lse(flex_attention, flex_module, q, k, v, **kwargs):
    """``flex_attention``'s output and log-sum-exp: ``return_aux=AuxRequest(lse=True)`` from PyTorch 2.9 on,
    ``return_lse=True`` before (deprecated in 2.9)."""
    if hasattr(flex_module, "AuxRequest"):
        out, aux = flex_attention(q, k, v, return_aux=flex_module.AuxRequest(lse=True), **kwargs)
        return out, aux.lse
    return flex_attention(q, k, v, return_lse=True, **kwargs)

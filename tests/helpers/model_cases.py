"""Methods applied to tiny models, the families whose caches differ, and their inputs (tests/test_caches_and_calls.py;
tests/test_cuda.py runs the same on a GPU)."""

import torch

METHODS = {
    "string": dict(shift=20, local_window=4),
    "rerope": dict(window=30, leak=2.0),
    "self_extend": dict(group_size=3, neighbor_window=16),
    "dca": dict(chunk_size=30, local_window=6),
    "dynamic_drop": dict(chunk=8, initial_rate=0.2, layers=(0, 1)),
    "dpe": dict(
        group_scales=(2, 3, 1, 4),
        local_window=12,
        top_k=3,
        dimensions=torch.rand(2, 4, 8, generator=torch.Generator().manual_seed(1)),
    ),
}
CACHE_FAMILIES = {"llama": {}, "mistral": {"sliding_window": 24}, "gemma3": {}}  # full, sliding, hybrid caches


def ids(n, seed=0, batch=2):
    return torch.randint(3, 97, (batch, n), generator=torch.Generator().manual_seed(seed))


def left_padded(n=40, pad=7, seed=0):
    x = ids(n, seed)
    mask = torch.ones_like(x)
    mask[1, :pad] = 0
    return x, mask

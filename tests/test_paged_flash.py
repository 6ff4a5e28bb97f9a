"""The CUDA backend's algorithm (longreach.attention.paged_flash: a FlashAttention call per cell, merged) against the
float64 dense reference, its two vLLM functions emulated on the CPU (tests/helpers/flash_emulation.py): the same mixed
batch of requests as the CPU kernel's tests (tests/helpers/paged.py), keys moved into planes written as vLLM caches
them. It has not run on a GPU."""

import pytest
import torch
from helpers import flash_emulation
from helpers.paged import METHODS, REQUESTS, run

from longreach.attention.cells import lower
from longreach.attention.paged_flash import spans_problem
from longreach.methods import create


@pytest.mark.slow
@pytest.mark.parametrize("name, params", [(n, p) for n, p in METHODS if n != "dca"])
def test_every_distance_method_matches_the_reference_through_flash_attention_calls(name, params):
    method = create(name, training_window=600, **params)
    got, want, cells = run(method)
    assert spans_problem(cells) is None
    assert (got - want).abs().max() <= 2e-5


@pytest.mark.slow
def test_string_is_two_calls_and_one_merge(monkeypatch):
    """The band with the window (S - 1, 0), the far part on S fewer keys, the query turned back by S - W."""
    calls = []
    real = flash_emulation.flash_attn_varlen_func

    def counted(**kwargs):
        calls.append((kwargs["window_size"], kwargs["seqused_k"].tolist()))
        return real(**kwargs)

    monkeypatch.setattr(flash_emulation, "flash_attn_varlen_func", counted)
    got, want, _ = run(create("string", training_window=600, shift=300, local_window=30))
    lengths = [n for n, _ in REQUESTS]
    assert sorted(calls) == sorted([([299, 0], lengths), ([-1, 0], [max(n - 300, 0) for n in lengths])])
    assert (got - want).abs().max() <= 2e-5


@pytest.mark.slow
def test_bfloat16_and_the_models_sliding_window():
    method = create("rerope", training_window=600, window=50)
    got, want, _ = run(method, torch.bfloat16)
    assert (got.double() - want).abs().max() <= 3e-2
    got, _, _ = run(create("string", training_window=600, shift=300, local_window=30), window=100)
    windowed, _, _ = run(create("rope", training_window=600), window=100)
    assert (got - windowed).abs().max() <= 2e-5  # STRING's far part lies beyond a window of 100


@pytest.mark.slow
@pytest.mark.parametrize("chunk_size, local_window", [(180, 20), (90, 10)])
def test_dca_by_three_calls_over_pieces_cut_at_chunk_edges_matches_the_reference(chunk_size, local_window):
    """Chunks of 160 and 80 keys (whole blocks of 16) over requests of up to 1,300 keys: prefills across several
    chunks, a chunk, decoding steps; each request's queries cut at the chunk edges, three calls and two merges."""
    method = create("dca", training_window=600, chunk_size=chunk_size, local_window=local_window)
    got, want, cells = run(method, block_size=16)
    assert spans_problem(cells, method.chunk, 16) is None
    assert (got - want).abs().max() <= 2e-5


def test_dca_is_refused_where_its_chunk_is_no_whole_number_of_blocks_or_the_layer_has_a_window():
    method = create("dca", training_window=600, chunk_size=200, local_window=20)
    assert "DCA" in spans_problem(lower(method.parts(), None))  # no block size: no distance bound
    assert spans_problem(lower(method.parts(), None), 180, 16).startswith("chunk_size - local_window = 180 is not")
    assert "sliding-window" in spans_problem(lower(method.parts(), 100), 180, 20)

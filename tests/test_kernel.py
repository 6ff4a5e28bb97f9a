"""The parts kernel against the dense per-pair reference, on random inputs."""

import pytest
import torch
from helpers.cases import BASELINES, attend, case, expected, inv_freq_for
from helpers.memory import measure_peak_growth
from helpers.tiny_models import tiny_model

import longreach
from longreach.attention import kernel, merge, plan, shifts, views
from longreach.attention.backends import cpu_fused
from longreach.attention.backends import triton as fused
from longreach.attention.parts import Part
from longreach.methods import create


def rows_strided(x: torch.Tensor) -> torch.Tensor:
    """The same values, each row's elements a stride apart (as a gathered block of vLLM's transposed key cache)."""
    return x.float().transpose(-1, -2).contiguous().transpose(-1, -2).requires_grad_(x.requires_grad)


@pytest.mark.parametrize("backend", ["cpu_flash", "math"])
def test_rows_whose_elements_are_strided_give_the_reference_and_its_gradients(backend):
    """PyTorch's CPU flash attention reads a row's elements as adjacent whatever their stride says (torch 2.13, no
    error): STRING's unmoved band read vLLM's transposed keys as other numbers. The backends hand it adjacent rows."""
    method = create("string", training_window=60, shift=20, local_window=4)
    q, k, v, q_rot, k_rot, positions, padding, inv_freq = case(50, pads=(0, 7))
    for q_len in (50, 1):
        want, rows = expected(method, q, k, v, positions, padding, inv_freq, q_len, scaling=0.3)
        inputs = [x.float().requires_grad_() for x in (q_rot[:, :, -q_len:], k_rot, v)]
        outs = [
            kernel.attention(
                *(rows_strided(x) if strided else x for x in inputs), method.parts(), inv_freq.float(), scaling=0.3,
                key_padding=padding, positions=positions, backend=backend,
            )
            for strided in (False, True)
        ]  # fmt: skip
        assert (outs[1] - want)[rows].abs().max() <= 1e-5, q_len
        grads = [torch.autograd.grad(out[rows].sum(), inputs) for out in outs]
        assert all((a - b).abs().max() <= 1e-5 for a, b in zip(*grads, strict=True))


STRING_CASES = [(n, S, W) for n, S, W in [(7, 9, 2), (10, 9, 2), (33, 9, 2), (40, 16, 1), (64, 17, 16), (57, 20, 5)]]


@pytest.mark.parametrize("n, S, W", STRING_CASES)
@pytest.mark.parametrize("pads", [(0, 0), (0, 5)])
@pytest.mark.parametrize("backend", ["cpu_flash", "math", pytest.param("flex", marks=pytest.mark.slow)])
def test_string_prefill_and_decode_match_the_reference_fp32(n, S, W, pads, backend):
    """Includes n < S (no far part), n = S + 1 (one far pair), GQA 4:2, left padding."""
    method = create("string", training_window=3 * S, shift=S, local_window=W)
    example = case(n, pads=pads)
    q, k, v, q_rot, k_rot, positions, padding, inv_freq = example
    padding_arg = None if all(p == 0 for p in pads) else padding
    for q_len in (n, 1, 3):  # prefill, one-token decode, a chunk against the cache
        want, rows = expected(method, q, k, v, positions, padding, inv_freq, q_len, scaling=0.3)
        got = attend(method, example, q_len, scaling=0.3, key_padding=padding_arg, backend=backend, tile=8)
        assert got.dtype == torch.float32 and not got.isnan().any()
        assert (got - want)[rows].abs().max() <= 1e-5


def test_float64_math_backend_is_exact():
    method = create("string", training_window=60, shift=20, local_window=4)
    example = case(50, pads=(0, 7))
    q, k, v, q_rot, k_rot, positions, padding, inv_freq = example
    want, rows = expected(method, q, k, v, positions, padding, inv_freq, 50, scaling=0.25)
    got = attend(method, example, dtype=torch.float64, scaling=0.25, key_padding=padding, tile=16)
    assert got.dtype == torch.float64
    assert (got - want)[rows].abs().max() <= 1e-12


@pytest.mark.parametrize("dtype, tolerance", [(torch.bfloat16, 0.05), (torch.float16, 0.01)])
@pytest.mark.parametrize("backend", ["auto", "flex"])
def test_low_precision_inputs(dtype, tolerance, backend):
    method = create("string", training_window=60, shift=20, local_window=4)
    example = case(48, pads=(0, 3))
    q, k, v, q_rot, k_rot, positions, padding, inv_freq = example
    want, rows = expected(method, q, k, v, positions, padding, inv_freq, 48, scaling=0.25)
    got = attend(method, example, dtype=dtype, scaling=0.25, key_padding=padding, backend=backend)
    assert got.dtype == dtype and not got.isnan().any()
    assert (got.double() - want)[rows].abs().max() <= tolerance


def test_partial_rotary_and_logit_scale():
    method = create("string", training_window=30, shift=10, local_window=3, mscale=True)
    example = case(30, dim=16, rotary_dims=8)
    q, k, v, q_rot, k_rot, positions, padding, inv_freq = example
    want, _ = expected(method, q, k, v, positions, padding, inv_freq, 30, scaling=0.3)
    got = attend(method, example, scaling=0.3, logit_scale=method.logit_scale)
    assert (got - want).abs().max() <= 1e-5


@pytest.mark.parametrize("backend", ["auto", "flex"])
def test_sliding_window_limits_every_part(backend):
    method = create("string", training_window=45, shift=15, local_window=2)
    example = case(40)
    q, k, v, q_rot, k_rot, positions, padding, inv_freq = example
    for window in (8, 25):
        want, _ = expected(method, q, k, v, positions, padding, inv_freq, 40, scaling=0.3, window=window)
        got = attend(method, example, scaling=0.3, sliding_window=window, backend=backend)
        assert (got - want).abs().max() <= 1e-5


def test_flex_block_masks_sort_tiles_into_full_partial_and_empty():
    """STRING's far part (d >= 200) over 4 x 4 tiles of 128, and 300 tokens (the last tile cut short):
    the tile lists say exactly which tiles FlexAttention skips, computes whole, or masks pair by pair."""
    from longreach.attention.backends.flex import masks

    for n in (512, 300):
        mask = masks.Region(200, None, 0).block_mask(1, n, n, "cpu")
        i = torch.arange(512)
        inside = ((i[:, None] - i[None, :] >= 200) & (i[:, None] < n) & (i[None, :] < n)).view(4, 128, 4, 128)
        tiles = -(-n // 128)
        full, any_pair = inside.all(3).all(1)[:tiles, :tiles], inside.any(3).any(1)[:tiles, :tiles]
        partial = any_pair & ~full
        for count, indices, want in [
            (mask.kv_num_blocks, mask.kv_indices, partial),
            (mask.full_kv_num_blocks, mask.full_kv_indices, full),
        ]:
            for row in range(tiles):
                listed = indices[0, 0, row, : count[0, 0, row]].tolist()
                assert sorted(listed) == want[row].nonzero().flatten().tolist()
        assert partial.any() and not any_pair[0].any() and (full.any() == (n == 512))  # a cut tile is never full


@pytest.mark.parametrize(
    "name, params",
    [
        ("string", {"shift": 150, "local_window": 20}),
        ("dca", {"chunk_size": 200, "local_window": 40}),
        ("dca", {"chunk_size": 90, "local_window": 20}),
    ],
)
@pytest.mark.parametrize("q_len", [700, 300, 1])
def test_flex_tile_classes_from_arithmetic_are_sound(name, params, q_len):
    """Block masks come from tile arithmetic (distance ranges, padding and key positions per tile), not a pass
    over the pairs: no allowed pair lies in a tile classed empty, no other pair in a tile classed full --
    padded batch, DCA's key spans, a chunk and a decoding step against the cache, a last tile cut short."""
    from longreach.attention.backends.flex import masks

    kv_len = 700
    padding = torch.stack([torch.arange(kv_len) >= pad for pad in (0, 130, 300)])
    positions = (padding.long().cumsum(-1) - 1).masked_fill(~padding, -1)
    offset = kv_len - q_len
    q_positions = positions[:, offset:]
    for part in create(name, training_window=600, **params).parts():
        span = None if part.key_span is None else (*part.key_span(q_positions), positions)
        region = masks.Region(part.min_distance, part.max_distance, offset, padding, span)
        mask = region.block_mask(3, q_len, kv_len, "cpu")
        b, i, j = (
            torch.arange(3)[:, None, None],
            torch.arange(q_len)[None, :, None],
            torch.arange(kv_len)[None, None, :],
        )
        allowed = region.allowed(b, i, j)  # [3, Lq, Lkv]
        q_tiles, kv_tiles = -(-q_len // 128), -(-kv_len // 128)
        grid = torch.zeros(3, q_tiles * 128, kv_tiles * 128, dtype=torch.bool)
        grid[:, :q_len, :kv_len] = allowed
        tiles = grid.view(3, q_tiles, 128, kv_tiles, 128)
        for seq in range(3):
            for row in range(q_tiles):
                partial = set(mask.kv_indices[seq, 0, row, : mask.kv_num_blocks[seq, 0, row]].tolist())
                full = set(mask.full_kv_indices[seq, 0, row, : mask.full_kv_num_blocks[seq, 0, row]].tolist())
                rows = slice(0, min(128, q_len - row * 128))
                for col in range(kv_tiles):
                    cols = slice(0, min(128, kv_len - col * 128))
                    pairs = tiles[seq, row, rows, col, cols]
                    if col in full:
                        assert pairs.all() and col not in partial
                    elif col not in partial:
                        assert not pairs.any(), (seq, row, col)


def test_dca_tiles_reach_only_their_chunks_and_need_no_mask():
    """Chunk size 48, local window 16 (c = 32), 128 tokens, query tiles of 16 (inside one chunk): each
    tile of each part calls the backend over exactly the keys of its chunk relation, without a mask:
    the same chunk is a rectangle and a causal square, the previous and earlier chunks one rectangle
    each; a decoding query has no mask either."""
    c, n, tile = 32, 128, 16
    same, previous, earlier = create("dca", training_window=64, chunk_size=48, local_window=16).parts()
    positions = torch.arange(n)[None]
    for start in range(0, n, tile):
        chunk = start // c * c
        want = {
            same: [(chunk, start, False), (start, start + tile, True)],
            previous: [(chunk - c, chunk, False)],
            earlier: [(0, chunk - c, False)],
        }
        for part, blocks in want.items():
            got = list(
                plan.masked_tiles(
                    tile,
                    n,
                    part.min_distance,
                    part.max_distance,
                    start,
                    None,
                    0,
                    (part.key_span, positions),
                    tile,
                    torch.float32,
                    "cpu",
                )
            )
            assert [(b.keys.start, b.keys.stop, b.causal) for b in got if b.mask is None] == [
                b for b in blocks if b[1] > max(0, b[0])
            ]
            assert all(b.mask is None for b in got)
    for part in (same, previous, earlier):
        keys, allowed = plan._region(
            torch.tensor([100]), part.min_distance, part.max_distance, n, None, (part.key_span, positions)
        )
        assert allowed.dim() == 0 and bool(allowed)


def test_left_padding_masks_only_the_padded_first_keys():
    """Prefill of a left-padded batch (pads 0, 5, 13): masked tiles (narrow bands, DCA) meet keys 0-12
    with a mask and the rest as an unpadded tile would (a rectangle and a causal square, no mask); an
    unbounded part (rope) is the padded keys' masked tiles and then one causal call over all later rows,
    as without padding. No mask grows with n; decoding is one small masked call."""
    n, tile, pads = 96, 16, (0, 5, 13)
    padding = torch.stack([torch.arange(n) >= pad for pad in pads])
    padded = plan.padded_keys(padding, n, n)
    assert padded == 13 and plan.padded_keys(padding, 1, n) == n and plan.padded_keys(None, n, n) == 0
    blocks = list(plan.masked_tiles(n, n, 0, None, 0, padding, padded, None, tile, torch.float32, "cpu"))
    for start in range(tile, n, tile):  # the first tile holds the padding itself
        got = [b for b in blocks if b.rows.start == start]
        assert [(b.keys.start, b.keys.stop, b.mask.shape) for b in got if b.mask is not None] == [
            (0, 13, (3, 1, tile, 13))
        ]
        assert [(b.keys.start, b.keys.stop, b.causal) for b in got if b.mask is None] == [
            (13, start, False),
            (start, start + tile, True),
        ]
    rope = list(plan.blocks(n, n, 0, None, 0, padding, padded, None, tile, True, torch.float32, "cpu"))
    assert all(b.keys.stop <= 13 and b.mask is not None for b in rope[:-1])
    assert rope[-1] == plan.Block(slice(13, n), slice(13, n), causal=True)
    decode = list(plan.masked_tiles(1, n, 0, None, n - 1, padding, n, None, tile, torch.float32, "cpu"))
    assert [(b.keys.start, b.keys.stop, b.mask is not None) for b in decode] == [(0, n, True)]  # one small masked call


def covered(blocks, batch: int, q_len: int, kv_len: int) -> torch.Tensor:
    """How many of ``blocks`` cover each (sequence, query row, key) pair, from their slices and masks."""
    count = torch.zeros(batch, q_len, kv_len, dtype=torch.long)
    for b in blocks:
        rows, keys = b.rows.stop - b.rows.start, b.keys.stop - b.keys.start
        inside = torch.ones(batch, rows, keys, dtype=torch.bool)
        if b.causal:
            inside &= torch.ones(rows, keys, dtype=torch.bool).tril()
        if b.flipped:  # causal on rows and keys reversed
            inside &= torch.ones(rows, keys, dtype=torch.bool).tril().flip(0, 1)
        if b.mask is not None:
            mask = b.mask if b.mask.dim() == 2 else b.mask[:, 0]
            inside &= (mask == 0).expand(batch, rows, keys)
        count[:, b.rows, b.keys] += inside
    return count


@pytest.mark.parametrize("lo, hi", [(0, None), (7, None), (0, 40), (5, 45), (0, 9)])
@pytest.mark.parametrize("pads", [(0, 0), (0, 5, 13), (3, 40), (0, 70)])
@pytest.mark.parametrize("q_len", [70, 33, 17, 1])
def test_every_plan_covers_each_allowed_pair_exactly_once(lo, hi, pads, q_len):
    """Unbounded parts, wide and narrow bands; no padding, padding shorter and longer than a tile, and
    past the first queries; prefill, chunks against a cache, decoding: each pair ``lo <= i - j < hi``
    with a real key is in exactly one call, every other pair in none (tiles of 8)."""
    kv_len, tile = 70, 8
    padding = torch.stack([torch.arange(kv_len) >= pad for pad in pads])
    offset = kv_len - q_len
    i, j = torch.arange(offset, kv_len)[:, None], torch.arange(kv_len)[None, :]
    allowed = (j <= i - lo) & (j > i - hi if hi is not None else True) & padding[:, None, :]
    for key_padding in (padding, None) if not any(pads) else (padding,):
        padded = plan.padded_keys(key_padding, q_len, kv_len)
        for structured in (True, False):
            blocks = plan.blocks(
                q_len,
                kv_len,
                lo,
                hi,
                offset,
                key_padding,
                padded,
                None,
                tile,
                structured and q_len > 16,
                torch.float32,
                "cpu",
            )
            assert torch.equal(covered(blocks, len(pads), q_len, kv_len), allowed.long()), (
                key_padding is None,
                structured,
            )


@pytest.mark.parametrize(
    "name, params",
    [
        ("rope", {}),
        ("string", {"shift": 20, "local_window": 4}),
        ("self_extend", {"group_size": 3, "neighbor_window": 10}),
        ("dca", {"chunk_size": 24, "local_window": 6}),
    ],
)
def test_left_padded_batches_match_the_reference_across_the_padding_edge(name, params):
    """Three sequences padded 0, 5 and 13 keys, tiles of 8 that end inside and past the padding, GQA 4:2."""
    method = create(name, training_window=40, **params)
    example = case(61, batch=3, pads=(0, 5, 13))
    q, k, v, q_rot, k_rot, positions, padding, inv_freq = example
    for q_len in (61, 30, 1):
        want, rows = expected(method, q, k, v, positions, padding, inv_freq, q_len, scaling=0.3)
        got = attend(method, example, q_len, scaling=0.3, key_padding=padding, positions=positions, tile=8)
        assert not got.isnan().any()
        assert (got - want)[rows].abs().max() <= 1e-5


def test_flex_has_no_backward_on_cpu_and_says_so():
    method = create("string", training_window=60, shift=20, local_window=4)
    q, k, v, q_rot, k_rot, positions, padding, inv_freq = case(30)
    q_rot = q_rot.float().requires_grad_()
    with pytest.raises(ValueError, match="backend='flex' has no backward on cpu"):
        kernel.attention(q_rot, k_rot.float(), v.float(), method.parts(), inv_freq.float(), backend="flex")


def test_additive_masks_are_zero_where_allowed_and_minus_infinity_elsewhere():
    allowed = torch.rand(2, 1, 3, 75, generator=torch.Generator().manual_seed(0)) > 0.5
    mask = plan.additive(allowed, torch.bfloat16)
    assert mask.shape == allowed.shape and mask.dtype == torch.bfloat16
    assert torch.equal(mask == 0, allowed) and torch.isneginf(mask[~allowed]).all()


def test_rows_with_an_empty_part_or_no_key_give_no_nan():
    """Padding query rows see no key at all; early rows see no far key. Neither may give NaN."""
    method = create("string", training_window=30, shift=10, local_window=3)
    example = case(20, pads=(0, 12))
    *_, padding, _ = example
    out = attend(method, example, key_padding=padding)
    assert not out.isnan().any()
    assert out[1, :12].abs().max() == 0  # rows of padding tokens


def test_merge_is_stable_for_huge_and_empty_log_sum_exps():
    out_a, out_b = torch.ones(3, 2), 2 * torch.ones(3, 2)
    lse_a = torch.tensor([1000.0, float("-inf"), float("-inf")])
    lse_b = torch.tensor([1000.0, 5.0, float("-inf")])
    out, lse = merge.merge(out_a, lse_a, out_b, lse_b)
    assert torch.allclose(out, torch.tensor([[1.5, 1.5], [2.0, 2.0], [0.0, 0.0]]))
    assert lse[0] == pytest.approx(1000 + torch.log(torch.tensor(2.0)).item()) and lse[2] == float("-inf")


def test_rope_part_alone_is_causal_sdpa():
    q, k, v, q_rot, k_rot, *_ = case(37, q_heads=4, kv_heads=4)
    got = kernel.attention(q_rot.float(), k_rot.float(), v.float(), [Part()], inv_freq_for(16).float())
    want = torch.nn.functional.scaled_dot_product_attention(q_rot.float(), k_rot.float(), v.float(), is_causal=True)
    assert (got - want.transpose(1, 2)).abs().max() <= 1e-6


def test_bad_shapes_and_backend_are_clear_errors():
    x = torch.zeros(1, 3, 4, 8)
    with pytest.raises(ValueError, match=r"query heads \(3\) must be a multiple of key/value heads \(2\)"):
        kernel.attention(x, torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8), [Part()], inv_freq_for(8))
    with pytest.raises(ValueError, match="backend='cuda' is not one of"):
        kernel.attention(x, x, x, [Part()], inv_freq_for(8), backend="cuda")
    with pytest.raises(ValueError, match="query length 4 exceeds key length 2"):
        kernel.attention(x, x[:, :, :2], x[:, :, :2], [Part()], inv_freq_for(8))


MEMORY_PROBE = """
import resource, torch
from longreach.attention import kernel
from longreach.methods import create
n = 16384
torch.manual_seed(0)
q, k, v = (torch.randn(1, 1, n, 64) for _ in range(3))
inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))
warm_up = [x[:, :, :64] for x in (q, k, v)]
kernel.attention(*warm_up, create("string", training_window=n).parts(), inv_freq)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = kernel.attention(q, k, v, create("string", training_window=n).parts(), inv_freq)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print((after - before) * 1024)
"""


def test_kernel_memory_at_16k_is_far_below_one_dense_matrix():
    """One 16,384^2 float32 matrix is 1 GiB; the kernel's peak growth must stay under 1/16 of it."""
    grown = measure_peak_growth(MEMORY_PROBE)
    assert grown < (1 << 30) // 16, f"peak memory grew by {grown / 2**20:.0f} MiB"


@pytest.mark.parametrize("n, S, tile", [(100, 40, 32), (150, 70, 32), (150, 70, 48), (129, 64, 63)])
def test_structured_path_for_long_inputs_matches_the_reference(n, S, tile):
    """Long unpadded inputs take the rectangle/causal-square and three-block band path."""
    method = create("string", training_window=3 * S, shift=S, local_window=8)
    example = case(n, batch=1, pads=(0,))
    q, k, v, q_rot, k_rot, positions, padding, inv_freq = example
    for q_len in (n, 50, 20):  # prefill, and chunks against a cache
        want, _ = expected(method, q, k, v, positions, padding, inv_freq, q_len, scaling=0.3)
        got = attend(method, example, q_len, scaling=0.3, tile=tile)
        assert (got - want).abs().max() <= 1e-5


def test_sliding_window_bands_with_a_lower_bound():
    """STRING's far part under a sliding window is a band [S, window): the band path with lo > 0."""
    method = create("string", training_window=120, shift=40, local_window=8)
    example = case(150, batch=1, pads=(0,))
    q, k, v, q_rot, k_rot, positions, padding, inv_freq = example
    want, _ = expected(method, q, k, v, positions, padding, inv_freq, 150, scaling=0.3, window=100)
    got = attend(method, example, scaling=0.3, sliding_window=100, tile=32)
    assert (got - want).abs().max() <= 1e-5


@pytest.mark.parametrize("name, params", BASELINES)
@pytest.mark.parametrize("pads", [(0, 0), (0, 7)])
@pytest.mark.parametrize(
    "n, tile, backend", [(57, 16, "auto"), (140, 64, "auto"), pytest.param(140, 64, "flex", marks=pytest.mark.slow)]
)
def test_baselines_prefill_and_decode_match_the_reference_fp32(name, params, pads, n, tile, backend):
    """Per-token shifts (absolute positions, left padding) and DCA's chunk spans, GQA 4:2; FlexAttention
    at more than one of its 128-token tiles."""
    method = create(name, training_window=40, **params)
    example = case(n, pads=pads)
    q, k, v, q_rot, k_rot, positions, padding, inv_freq = example
    for q_len in (n, 1, 20):
        want, rows = expected(method, q, k, v, positions, padding, inv_freq, q_len, scaling=0.3)
        got = attend(
            method,
            example,
            q_len,
            scaling=0.3,
            key_padding=padding if pads[1] else None,
            positions=positions,
            tile=tile,
            backend=backend,
        )
        assert not got.isnan().any()
        assert (got - want)[rows].abs().max() <= 1e-5


def test_key_rotations_are_reused_only_while_positions_and_frequencies_agree(monkeypatch):
    """The angle cache behind decoding: a step extends the entry by its new positions; another prefix
    (a reordered or re-padded batch), other frequencies or a new shift object recompute."""
    rotations = shifts.KeyRotations(size=2)
    shift = create("self_extend", training_window=40, group_size=3, neighbor_window=10).parts()[1].key_shift
    inv_freq = inv_freq_for(8)

    def direct(positions, inv_freq):
        return reference_angles(shift, positions, inv_freq)

    computed = []  # how many positions each call computes angles for
    angles = shifts.shift_angles
    monkeypatch.setattr(
        shifts, "shift_angles", lambda shift, p, f, dtype: computed.append(p.shape[1]) or angles(shift, p, f, dtype)
    )
    positions = torch.arange(20).expand(2, -1)
    calls = [
        (positions[:, :15], inv_freq),
        (positions, inv_freq),
        (positions.flip(0) - torch.tensor([[0], [3]]), inv_freq),
        (positions, inv_freq * 1.5),
        (positions[:, :20], inv_freq * 1.5),
    ]
    for p, f in calls:
        cos, sin = rotations.get(shift, p, f, torch.float64)
        want_cos, want_sin = direct(p, f)
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    assert computed == [15, 5, 20, 20]  # the second call extends by 5; the last one reuses the whole entry
    assert len(rotations.entries) == 1 and rotations.entries[id(shift)][1].shape == (2, 20)


def reference_angles(shift, positions, inv_freq):
    angle = shift(positions.to(torch.float64))[:, None, :, None] * inv_freq.to(torch.float64)
    return angle.cos(), angle.sin()


@pytest.mark.parametrize("pads", [(0, 0), (3, 9)])
def test_dca_decoding_turns_the_query_per_chunk_instead_of_the_cached_keys(monkeypatch, pads):
    """DCA's key shift is constant on each chunk: a decoding step (and a short chunk of queries) moves
    the query by each chunk's shift, never the cached keys, and still equals the reference (left padding
    included)."""
    method = create("dca", training_window=40, chunk_size=16, local_window=4)
    example = case(70, pads=pads)
    q, k, v, q_rot, k_rot, positions, padding, inv_freq = example
    monkeypatch.setattr(
        views, "shifted_keys", lambda key, shift, *args: key if not shift else pytest.fail("a key was rotated")
    )
    for q_len in (1, 5):
        want, rows = expected(method, q, k, v, positions, padding, inv_freq, q_len, scaling=0.3)
        key_padding = padding if pads[1] else None
        got = attend(method, example, q_len, scaling=0.3, key_padding=key_padding, positions=positions)
        assert (got - want)[rows].abs().max() <= 1e-5


@pytest.mark.parametrize("name, params", [("rope", {}), ("string", {"shift": 20, "local_window": 4}), *BASELINES])
def test_the_compiled_decoding_step_equals_the_reference(name, params):
    """compiled_step.attention, the sync-free step: every cache slot scored, padding and a static cache's empty slots
    (-1, -2) masked on the device; one step and a chunk of 5, GQA, float64."""
    from longreach.attention import compiled_step

    method = create(name, training_window=40, **params)
    q, k, v, q_rot, k_rot, positions, padding, inv_freq = case(61, batch=2, pads=(0, 7))
    extra = torch.randn(
        2, 2, 9, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(5)
    )  # empty slots hold garbage
    marks = torch.cat([positions.masked_fill(~padding, -1), torch.full((2, 9), -2)], dim=1)
    for q_len in (1, 5):
        want, rows = expected(method, q, k, v, positions, padding, inv_freq, q_len, scaling=0.3)
        got = compiled_step.attention(
            q_rot[:, :, -q_len:],
            torch.cat([k_rot, extra], 2),
            torch.cat([v, extra], 2),
            method.layer_parts(0),
            inv_freq,
            marks,
            scaling=0.3,
            logit_scale=method.logit_scale,
        )
        assert (got - want)[rows].abs().max() <= 1e-12


def test_the_compiled_steps_drop_attention_equals_the_tiled_one():
    """compiled_step.drop_below_quantile (a sort) keeps exactly the scores whole_rows.drop_below_quantile (a selection)
    keeps."""
    from longreach.attention import compiled_step, whole_rows

    generator = torch.Generator().manual_seed(2)
    scores = torch.randn(2, 3, 4, 50, generator=generator, dtype=torch.float64).round(decimals=1)  # ties included
    scores[..., 40:] = float("-inf")
    scores[1, :, 2] = float("-inf")  # a row that attends nothing
    rates = torch.tensor([[0.0, 0.3, 0.5, 0.99], [0.2, 0.01, 0.4, 0.7]], dtype=torch.float64)
    assert torch.equal(compiled_step.drop_below_quantile(scores, rates), whole_rows.drop_below_quantile(scores, rates))


@pytest.mark.parametrize(
    "name, params",
    [
        ("string", {"shift": 100, "local_window": 10}),
        ("string", {"shift": 40, "local_window": 5, "mscale": True}),
        ("rope", {}),
    ],
)
@pytest.mark.parametrize("pads, window", [((0, 0), None), ((0, 37), None), ((0, 37), 70)])
def test_flex_runs_string_as_one_softmax_over_the_turned_keys(monkeypatch, name, params, pads, window):
    """FlexAttention prefill of parts that move by constants: one call over ``[K | K_far]`` (K_far turned by
    S - W, each half tile-aligned, V used twice), no merge; 300 tokens (3 tiles, the last cut), GQA 4:2, left
    padding, a sliding window that cuts the far part; equal to the float64 reference."""
    from longreach.attention.backends import flex

    calls = []
    real = flex._function
    monkeypatch.setattr(
        flex,
        "_function",
        lambda device: lambda q, k, *args, **kwargs: calls.append(k.shape[2]) or real(device)(q, k, *args, **kwargs),
    )
    method = create(name, training_window=300, **params)
    example = case(300, pads=pads)
    q, k, v, q_rot, k_rot, positions, padding, inv_freq = example
    want, rows = expected(method, q, k, v, positions, padding, inv_freq, 300, scaling=0.3, window=window)
    key_padding = padding if pads[1] else None
    got = attend(method, example, scaling=0.3, key_padding=key_padding, sliding_window=window, backend="flex")
    assert (got - want)[rows].abs().max() <= 1e-5
    parts = 1 if name == "rope" or (window is not None and window <= params["shift"]) else 2
    assert calls == [parts * 384]  # one call over every part's keys, each part's segment 3 tiles of 128


@pytest.mark.parametrize(
    "name, params",
    [
        ("rerope", {"window": 40}),
        ("rerope", {"window": 40, "leak": 4.0}),
        ("self_extend", {"group_size": 3, "neighbor_window": 50}),
        ("dca", {"chunk_size": 160, "local_window": 30}),
        ("dca", {"chunk_size": 90, "local_window": 20}),
    ],
)
@pytest.mark.parametrize("q_len", [300, 40])
def test_flex_runs_every_part_in_one_launch(monkeypatch, name, params, q_len):
    """ReRoPE, Self-Extend and DCA move their queries by position: each such part has its own query segment
    against its keys' segment (``[Q; Q_far] x [K; K_far]``), all in one FlexAttention launch, the segments' rows
    merged by log-sum-exp. 300 keys (3 tiles, the last cut), prefill and a chunk, left padding, GQA 4:2."""
    from longreach.attention.backends import flex

    calls = []
    real = flex._function
    monkeypatch.setattr(
        flex,
        "_function",
        lambda device: lambda q, k, *args, **kwargs: calls.append(k.shape[2]) or real(device)(q, k, *args, **kwargs),
    )
    method = create(name, training_window=200, **params)
    example = case(300, pads=(0, 37))
    q, k, v, q_rot, k_rot, positions, padding, inv_freq = example
    want, rows = expected(method, q, k, v, positions, padding, inv_freq, q_len, scaling=0.3)
    got = attend(method, example, q_len, scaling=0.3, key_padding=padding, positions=positions, backend="flex")
    assert (got - want)[rows].abs().max() <= 1e-5
    assert len(calls) == 1


def test_flex_compiles_again_with_smaller_tiles_when_shared_memory_runs_out(monkeypatch):
    """Triton's "out of resource" (seen on an H200: the segmented masks of ReRoPE and Self-Extend asked for more
    shared memory than the GPU has) makes the call compile again with each of ``SMALLER_TILES`` in turn, and the
    kernel variant keeps the tiles that worked (others start from the default); any other error is raised as it was."""
    from longreach.attention.backends import flex

    asked = []
    real = flex._function

    def short_of_memory(device):
        def run(q, k, v, kernel_options=None, **kwargs):
            asked.append(kernel_options)
            if kernel_options is None or kernel_options.get("BLOCK_M", 128) > 32:
                raise RuntimeError(
                    "No valid triton configs. OutOfMemoryError: out of resource: triton_tem_fused_flex_attention_0 "
                    "Required: 233472 Hardware limit:232448"
                )
            return real(device)(q, k, v, **kwargs)

        return run

    monkeypatch.setattr(flex, "_function", short_of_memory)
    monkeypatch.setattr(flex, "_tiles_taken", {})
    method = create("rerope", training_window=200, window=40)
    q, k, v, q_rot, k_rot, positions, padding, inv_freq = case(300, pads=(0, 37))
    want, rows = expected(method, q, k, v, positions, padding, inv_freq, 300, scaling=0.3)
    arguments = (q_rot.float(), k_rot.float(), v.float(), method.parts(), inv_freq.float())
    common = dict(scaling=0.3, key_padding=padding, positions=positions, backend="flex")
    assert (kernel.attention(*arguments, **common) - want)[rows].abs().max() <= 1e-5
    assert asked == [None, *flex.SMALLER_TILES]
    kernel.attention(*arguments, **common)
    assert asked[-1] is flex.SMALLER_TILES[-1] and len(asked) == 5  # kept: no second search
    string = create("string", training_window=200, shift=60, local_window=8).parts()
    kernel.attention(*arguments[:3], string, arguments[4], **common)
    assert asked[5] is None  # another kernel variant starts from the default tiles
    monkeypatch.setattr(
        flex,
        "_function",
        lambda device: lambda *args, **kwargs: (_ for _ in ()).throw(RuntimeError("illegal memory access")),
    )
    with pytest.raises(RuntimeError, match="illegal memory access"):
        kernel.attention(*arguments, **common)


def test_memory_efficient_attention_gets_a_bias_with_aligned_rows():
    """PyTorch's memory-efficient CUDA kernel refuses a bias whose rows are not 16-byte aligned (an H200 run:
    "attn_bias.stride(2) = 39, and should be a multiple of 4"); ``aligned_rows`` pads the rows in memory only."""
    from longreach.attention.backends.cuda_efficient import aligned_rows

    for dtype, row in ((torch.float32, 4), (torch.bfloat16, 8)):
        mask = torch.randn(2, 1, 7, 40, dtype=torch.float64).to(dtype)[
            ..., 1:
        ]  # 39 keys, rows 40 apart, start off by one
        aligned = aligned_rows(mask)
        assert aligned.shape == mask.shape and torch.equal(aligned, mask)
        assert aligned.stride(-2) % row == 0 and aligned.stride(-1) == 1 and aligned.data_ptr() % 16 == 0
        ready = torch.zeros(1, 1, 3, 64, dtype=dtype)
        assert aligned_rows(ready) is ready


def test_auto_falls_back_with_one_warning_when_flexattention_fails_to_compile(monkeypatch):
    """Where ``auto`` chooses FlexAttention (CUDA; simulated here) and compiling it fails, the tiled kernel computes
    the call, with one warning for the process, never an error; an explicit backend='flex' still raises."""
    import warnings

    from torch._dynamo.exc import BackendCompilerFailed

    from longreach.attention import backends
    from longreach.attention.backends import flex

    def failing(device):
        def compile_and_run(*args, **kwargs):
            inner = RuntimeError("triton: no compiler for this GPU")
            try:
                failure = BackendCompilerFailed(lambda *a: None, inner, None)
            except TypeError:  # PyTorch 2.6 takes no traceback argument
                failure = BackendCompilerFailed(lambda *a: None, inner)
            raise failure

        return compile_and_run

    real_pick = backends.pick
    monkeypatch.setattr(
        kernel,
        "pick",
        lambda query, backend, **kwargs: (
            backends.REGISTRY["flex"]
            if backend == "auto" and flex.available(query.device, for_auto=True)
            else real_pick(query, "cpu_flash" if backend == "auto" else backend)
        ),
    )
    monkeypatch.setattr(flex, "_function", failing)
    monkeypatch.setattr(flex, "_compile_failure", [])
    method = create("string", training_window=60, shift=20, local_window=4)
    q, k, v, q_rot, k_rot, positions, padding, inv_freq = case(40)
    want, rows = expected(method, q, k, v, positions, padding, inv_freq, 40, scaling=0.3)
    arguments = (q_rot.float(), k_rot.float(), v.float(), method.parts(), inv_freq.float())
    with pytest.warns(UserWarning, match="compiling FlexAttention failed .*BackendCompilerFailed"):
        got = kernel.attention(*arguments, scaling=0.3)
    assert (got - want).abs().max() <= 1e-5
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert (
            kernel.attention(*arguments, scaling=0.3) - want
        ).abs().max() <= 1e-5  # no second warning, no second attempt
    with pytest.raises(BackendCompilerFailed):
        kernel.attention(*arguments, scaling=0.3, backend="flex")


def test_the_windowed_flash_backend_needs_cuda_and_half_precision():
    method = create("string", training_window=60, shift=20, local_window=4)
    with pytest.raises(
        ValueError,
        match="backend='cuda_flash' needs PyTorch's FlashAttention: a CUDA device and float16 or bfloat16 inputs",
    ):
        attend(method, case(20), backend="cuda_flash")


WHOLE_METHOD = [
    pytest.param("triton", marks=pytest.mark.skipif(not fused.available("cpu"), reason="needs Triton")),
    pytest.param("cpu_fused", marks=pytest.mark.skipif(not cpu_fused.available("cpu"), reason="needs a C++ compiler")),
]
"""The backends that take every part of a method in one pass (tests/test_fused.py, tests/test_native.py)."""


@pytest.mark.parametrize("backend", WHOLE_METHOD)
def test_whole_method_kernels_give_bfloat16_outputs_close_to_float32(backend):
    method = create("string", training_window=200, shift=70, local_window=9)
    g = torch.Generator().manual_seed(1)
    q, k, v = (
        torch.randn(1, 4, 130, 32, generator=g),
        torch.randn(1, 2, 130, 32, generator=g),
        torch.randn(1, 2, 130, 32, generator=g),
    )
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 32, 2) / 32))
    for q_len in (130, 1):
        got = kernel.attention(
            q[:, :, -q_len:].bfloat16(), k.bfloat16(), v.bfloat16(), method.parts(), inv_freq, backend=backend
        )
        want = kernel.attention(
            *(x.bfloat16().float() for x in (q[:, :, -q_len:], k, v)), method.parts(), inv_freq, backend="math"
        )
        assert got.dtype == torch.bfloat16
        assert (got.float() - want).abs().max() <= 2e-2


@pytest.mark.parametrize("backend", WHOLE_METHOD)
def test_whole_method_kernels_refuse_gradients_and_per_head_pairs_in_one_line(backend):
    method = create("string", training_window=60, shift=20, local_window=4)
    q, k, v, q_rot, k_rot, positions, padding, inv_freq = case(30)
    q_rot = q_rot.float().requires_grad_()
    with pytest.raises(ValueError, match=f"backend='{backend}' computes no gradients"):
        kernel.attention(q_rot, k_rot.float(), v.float(), method.parts(), inv_freq.float(), backend=backend)
    dpe = create(
        "dpe",
        training_window=60,
        group_scales=(2, 3, 1, 4),
        local_window=10,
        top_k=5,
        dimensions=torch.rand(1, 4, 8, generator=torch.Generator().manual_seed(3)),
    )
    with pytest.raises(ValueError, match="no per-head rotary pairs"):
        kernel.attention(
            q_rot.detach(), k_rot.float(), v.float(), dpe.layer_parts(0), inv_freq.float(), backend=backend
        )


@pytest.mark.slow
@pytest.mark.parametrize("backend", WHOLE_METHOD)
def test_a_model_generates_the_same_tokens_with_a_whole_method_kernel_as_on_tiles(backend):
    """DCA (three parts, key spans) in a model, left-padded: the same logits and the same tokens (dynamic and static
    cache) as the tiled kernel."""
    model = tiny_model("llama")
    x = torch.randint(3, 97, (2, 40), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(x)
    mask[1, :6] = 0  # left padding
    settings = dict(attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    outputs = {}
    for name in ("cpu_flash", backend):
        longreach.apply(model, "dca", backend=name, chunk_size=24, local_window=4)
        with torch.no_grad():
            outputs[name] = (
                model(x, attention_mask=mask).logits,
                model.generate(x, **settings),
                model.generate(x, cache_implementation="static", **settings),
            )
        longreach.remove(model)
    assert (outputs[backend][0] - outputs["cpu_flash"][0])[mask.bool()].abs().max() <= 1e-4
    assert torch.equal(outputs[backend][1], outputs["cpu_flash"][1]) and torch.equal(
        outputs[backend][2], outputs["cpu_flash"][2]
    )

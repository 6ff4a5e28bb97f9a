import torch

from longreach.attention.rotary import rotate


def hf_rotate(x, positions, inv_freq):
    """transformers' apply_rotary_pos_emb for one tensor, at integer positions."""
    freqs = positions[:, None].double() * inv_freq.double()
    emb = torch.cat((freqs, freqs), dim=-1)
    half = x.shape[-1] // 2
    rotated_half = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * emb.cos() + rotated_half * emb.sin()


def test_moving_a_rotated_vector_equals_rotating_at_the_sum():
    torch.manual_seed(0)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2).double() / 16))
    x = torch.randn(2, 3, 7, 16, dtype=torch.float64)
    positions = torch.arange(7)
    for delta in (-5, 3, 1000):
        moved = rotate(hf_rotate(x, positions, inv_freq), delta, inv_freq)
        assert torch.allclose(moved, hf_rotate(x, positions + delta, inv_freq), atol=1e-9)


def test_per_token_deltas_and_partial_rotary():
    torch.manual_seed(1)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2).double() / 8))  # 8 of 16 dims rotate
    x = torch.randn(1, 2, 5, 16, dtype=torch.float64)
    deltas = torch.tensor([0.0, 1.0, -2.0, 0.5, 7.0])
    moved = rotate(x, deltas, inv_freq)
    assert torch.equal(moved[..., 8:], x[..., 8:])
    for t in range(5):
        one = rotate(x[:, :, t : t + 1], float(deltas[t]), inv_freq)
        assert torch.allclose(moved[:, :, t : t + 1], one, atol=1e-12)
    assert torch.allclose(rotate(moved, -deltas, inv_freq), x, atol=1e-12)


def test_low_precision_inputs_keep_their_dtype():
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
    x = torch.randn(1, 1, 4, 8, dtype=torch.bfloat16)
    out = rotate(x, -3, inv_freq)
    assert out.dtype == torch.bfloat16
    assert torch.allclose(rotate(out.float(), 3, inv_freq), x.float(), atol=0.05)

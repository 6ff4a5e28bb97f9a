import pytest
import torch

from longreach import methods
from longreach.methods import create


def dense(method, n):
    positions = torch.arange(n)
    return method.relative_positions(positions[:, None], positions[None, :])


def test_string_reproduces_figure_5_of_the_paper():
    """L = 9, S = 3, W = 1 (An et al. 2025, Figure 5 (c)); -1 marks the masked upper triangle."""
    figure_5 = [
        [0, -1, -1, -1, -1, -1, -1, -1, -1],
        [1, 0, -1, -1, -1, -1, -1, -1, -1],
        [2, 1, 0, -1, -1, -1, -1, -1, -1],
        [1, 2, 1, 0, -1, -1, -1, -1, -1],
        [2, 1, 2, 1, 0, -1, -1, -1, -1],
        [3, 2, 1, 2, 1, 0, -1, -1, -1],
        [4, 3, 2, 1, 2, 1, 0, -1, -1],
        [5, 4, 3, 2, 1, 2, 1, 0, -1],
        [6, 5, 4, 3, 2, 1, 2, 1, 0],
    ]
    P = dense(create("string", window=9, shift=3, local_window=1), 9)
    assert torch.equal(torch.nan_to_num(P, nan=-1).long(), torch.tensor(figure_5))


def test_string_never_uses_the_dropped_tail_positions():
    L, S, W = 48, 16, 4
    P = dense(create("string", window=L, shift=S, local_window=W), L)
    assert P[~P.isnan()].max().item() == L - 1 - S + W


@pytest.mark.parametrize("n", [5, 13])
def test_parts_cover_the_causal_triangle_exactly_once(n):
    """Every causal pair falls in exactly one part and sees the dense rule's position there."""
    method = create("string", window=12, shift=4, local_window=2)
    P = dense(method, n)
    d = torch.arange(n)[:, None] - torch.arange(n)[None, :]
    covered = torch.zeros(n, n, dtype=torch.long)
    for part in method.parts():
        inside = (d >= part.min_distance) & ((d < part.max_distance) if part.max_distance else True)
        covered += inside.long()
        assert torch.equal(P[inside], (d + part.query_shift - part.key_shift)[inside].double())
    assert torch.equal(covered, (d >= 0).long())


def test_rope_is_the_distance():
    P = dense(create("rope", window=8), 6)
    d = (torch.arange(6)[:, None] - torch.arange(6)[None, :]).double()
    assert torch.equal(torch.nan_to_num(P, nan=-1), torch.where(d >= 0, d, -1.0))


def test_string_default_shift_is_a_third_of_the_window():
    assert create("string", window=8192).shift == 2731
    assert create("string", window=8192).local_window == 128


@pytest.mark.parametrize(
    "params, message",
    [
        ({"shift": 0}, "shift=0 is out of range"),
        ({"shift": 9}, "shift=9 is out of range"),
        ({"shift": 3.5}, "shift must be an integer"),
        ({"local_window": 0}, "local_window=0 is out of range"),
        ({"shift": 3, "local_window": 3}, "local_window=3 is out of range: 0 < local_window < shift = 3"),
        ({"local_window": True}, "local_window must be an integer"),
        ({"mscale": 1}, "mscale must be True or False"),
        ({"shift_size": 3}, "string has no parameter shift_size"),
    ],
)
def test_bad_string_parameters_name_the_parameter_and_range(params, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        create("string", window=9, **{"local_window": 1, **params})


def test_unknown_method_lists_the_supported_ones():
    with pytest.raises(ValueError, match="unknown method 'strng'; supported: rope, string"):
        create("strng", window=9)


def test_available_lists_every_method_with_defaults():
    rows = {row["name"]: row for row in methods.available()}
    assert set(rows) == set(methods.METHODS)
    assert rows["string"]["parameters"] == {"shift": None, "local_window": 128, "mscale": False}
    assert "2410.18745" in rows["string"]["paper"]

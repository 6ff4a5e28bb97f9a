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
    P = dense(create("string", training_window=9, shift=3, local_window=1), 9)
    assert torch.equal(torch.nan_to_num(P, nan=-1).long(), torch.tensor(figure_5))


def test_string_never_uses_the_dropped_tail_positions():
    L, S, W = 48, 16, 4
    P = dense(create("string", training_window=L, shift=S, local_window=W), L)
    assert P[~P.isnan()].max().item() == L - 1 - S + W


EVERY_METHOD = [
    ("rope", {}),
    ("string", {"shift": 4, "local_window": 2}),
    ("rerope", {"window": 5}),
    ("rerope", {"window": 5, "leak": 3.0}),
    ("self_extend", {"group_size": 3, "neighbor_window": 4}),
    ("dca", {"chunk_size": 6, "local_window": 2}),
    ("dca", {"chunk_size": 5, "local_window": 3}),  # s < 2l + 1: earlier chunks at 2c - 1, as ChunkLlama
]


def shift_at(shift, positions):
    return (
        shift(positions).double() if callable(shift) else torch.full(positions.shape, float(shift), dtype=torch.float64)
    )


@pytest.mark.parametrize("name, params", EVERY_METHOD)
@pytest.mark.parametrize("n", [5, 23])
def test_parts_cover_the_causal_triangle_exactly_once(name, params, n):
    """Every causal pair falls in exactly one part and sees the dense rule's position there."""
    method = create(name, training_window=12, **params)
    P = dense(method, n)
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    d = i - j
    assert torch.equal(torch.isnan(P), d < 0)  # the rule attends exactly the causal pairs
    covered = torch.zeros(n, n, dtype=torch.long)
    for part in method.parts():
        inside = (d >= part.min_distance) & ((d < part.max_distance) if part.max_distance else True)
        if part.key_span:
            first, stop = part.key_span(torch.arange(n)[:, None])
            inside &= (j >= first) & (j < stop)
        covered += inside.long()
        seen = (i + shift_at(part.query_shift, i)) - (j + shift_at(part.key_shift, j))
        assert torch.allclose(P[inside], seen.expand(n, n)[inside])
    assert torch.equal(covered, (d >= 0).long())


def test_worked_entries_of_the_baselines():
    rerope = dense(create("rerope", training_window=12, window=4), 12)
    assert rerope[10, 1] == 4 and rerope[10, 8] == 2
    leaky = dense(create("rerope", training_window=12, window=4, leak=2.0), 12)
    assert leaky[10, 0] == 4 + (10 - 4) / 2
    se = dense(create("self_extend", training_window=40, group_size=2, neighbor_window=4), 12)
    assert se[10, 1] == 10 // 2 - 1 // 2 + 4 - 4 // 2 == 7 and se[10, 7] == 3
    assert torch.equal(
        dense(create("self_extend", training_window=40, group_size=1, neighbor_window=4), 12).nan_to_num(-1),
        dense(create("rope", training_window=40), 12).nan_to_num(-1),
    )
    dca = dense(create("dca", training_window=40, chunk_size=6, local_window=2), 12)  # c = 4
    assert dca[9, 8] == 1  # same chunk: 9 mod 4 - 8 mod 4
    assert dca[9, 5] == min(1 + 4, 6) - 1 == 4  # previous chunk
    assert dca[9, 2] == min(2 * 4 - 1, 6) - 2 == 4  # earlier chunks
    assert dca[7, 1] == min(3 + 4, 6) - 1 == 5  # previous chunk, clamped at s


def test_rope_is_the_distance():
    P = dense(create("rope", training_window=8), 6)
    d = (torch.arange(6)[:, None] - torch.arange(6)[None, :]).double()
    assert torch.equal(torch.nan_to_num(P, nan=-1), torch.where(d >= 0, d, -1.0))


def test_string_default_shift_is_a_third_of_the_window():
    assert create("string", training_window=8192).shift == 2731
    assert create("string", training_window=8192).local_window == 128


@pytest.mark.parametrize(
    "window, shift, local_window",
    [(131072, 43691, 128), (2048, 683, 128), (600, 200, 37), (384, 128, 24), (256, 85, 16), (96, 32, 6), (10, 3, 1)],
)
def test_string_defaults_fit_every_window(window, shift, local_window):
    """The default W is min(128, L // 16), the paper's 128 at every L it evaluates (2K and up): 128 was out of range
    below L = 385 (W < S = L/3), an error naming a parameter the user never set."""
    method = create("string", training_window=window)
    assert (method.shift, method.local_window) == (shift, local_window)
    assert method.describe() == f"string(shift={shift}, local_window={local_window}, mscale=False)"


def test_a_shift_below_the_default_window_says_the_window_was_the_default():
    with pytest.raises(
        ValueError,
        match=r"local_window=16 is out of range: 0 < local_window < shift = 5 < L = 256 \(the default at "
        r"L = 256, min\(128, L // 16\): give a smaller local_window",
    ):
        create("string", training_window=256, shift=5)


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
        create("string", training_window=9, **{"local_window": 1, **params})


@pytest.mark.parametrize(
    "name, params, message",
    [
        ("rerope", {"window": 0}, "window=0 is out of range: 0 < window <= L = 12"),
        ("rerope", {"window": 13}, "window=13 is out of range"),
        ("rerope", {"leak": 1.0}, "leak=1.0 is out of range: a number > 1"),
        ("self_extend", {"group_size": 0}, "group_size=0 is out of range: group_size >= 1"),
        ("self_extend", {"neighbor_window": 2.5}, "neighbor_window must be an integer"),
        (
            "dca",
            {"chunk_size": 6, "local_window": 6},
            "local_window=6 is out of range: 0 < local_window < chunk_size = 6",
        ),
        ("dca", {"local_window": 0}, "local_window=0 is out of range"),
        ("dca", {"group": 2}, "dca has no parameter group"),
    ],
)
def test_bad_baseline_parameters_name_the_parameter_and_range(name, params, message):
    with pytest.raises(ValueError, match=message):
        create(name, training_window=12, **params)


def test_unknown_method_lists_the_supported_ones():
    every = "rope, string, rerope, self_extend, dca, dpe, pi, ntk, dynamic, yarn, llama3, drop, dynamic_drop"
    with pytest.raises(
        ValueError, match=rf"unknown method 'strng'; did you mean string\? methods: {every} \(`longreach methods`"
    ):
        create("strng", training_window=9)


def test_available_lists_every_method_with_defaults_and_ranges():
    rows = {row["name"]: row for row in methods.available()}
    assert set(rows) == {
        "rope",
        "string",
        "rerope",
        "self_extend",
        "dca",
        "pi",
        "ntk",
        "dynamic",
        "yarn",
        "llama3",
        "drop",
        "dynamic_drop",
        "dpe",
    }
    assert rows["dynamic_drop"]["parameters"]["chunk"] == 1000 and rows["drop"]["kind"] == "drop"
    assert rows["string"]["parameters"] == {"shift": None, "local_window": None, "mscale": False}  # both derived from L
    assert (
        "2410.18745" in rows["string"]["paper"]
        and "2402.17463" in rows["dca"]["paper"]
        and "2504.18857" in rows["dpe"]["paper"]
    )
    assert rows["dpe"]["parameters"] == {"group_scales": None, "local_window": 1024, "top_k": 48, "dimensions": None}
    for row in rows.values():
        assert row["changes"] and set(row["ranges"]) == set(row["parameters"])


def test_paper_baseline_protocol_pretends_a_window_of_two_thirds():
    assert methods.paper_baseline("yarn", 8192) == {"factor": 1.5, "original_max_position_embeddings": 5461}
    assert methods.paper_baseline("ntk", 8192) == {"factor": 1.5}
    assert methods.paper_baseline("dca", 8192) == {"chunk_size": 4095, "local_window": 682}
    assert methods.paper_baseline("rerope", 8192) == {"window": 2730}
    assert methods.paper_baseline("string", 8192) == {}

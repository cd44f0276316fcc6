"""The pure rank layout of 3D tensor parallelism: sub-axis groups and coordinates, no ranks."""

from __future__ import annotations

import itertools

import pytest

from megalite.core.tensor_parallel.modes.grid3d import (
    SUB_AXES_3D,
    Groups3D,
    grid3d_coords,
    grid3d_groups,
    other_layout,
)


def test_q2_groups_by_hand():
    # tp_rank = input + 2 * weight + 4 * output, global ranks 8..15 of the second TP group
    groups = grid3d_groups(list(range(8, 16)), 2)
    assert groups["input"] == [[8, 9], [10, 11], [12, 13], [14, 15]]
    assert groups["weight"] == [[8, 10], [9, 11], [12, 14], [13, 15]]
    assert groups["output"] == [[8, 12], [9, 13], [10, 14], [11, 15]]


@pytest.mark.parametrize("q", [1, 2, 3])
def test_groups_are_the_lines_of_the_cube(q):
    ranks = [100 + 7 * t for t in range(q**3)]  # any global ranks, in tp-rank order
    groups = grid3d_groups(ranks, q)
    for axis in SUB_AXES_3D:
        lines = groups[axis]
        assert len(lines) == q * q and all(len(line) == q for line in lines)
        assert sorted(r for line in lines for r in line) == ranks  # a partition of the TP group
        for line in lines:
            coords = [grid3d_coords(ranks.index(r), q) for r in line]
            assert [c[axis] for c in coords] == list(range(q))  # counting up along the axis
            for other in SUB_AXES_3D:
                if other != axis:
                    assert len({c[other] for c in coords}) == 1  # the others fixed
    # any two ranks share exactly the groups of the axes they agree on but one
    for a, b in itertools.combinations(range(q**3), 2):
        ca, cb = grid3d_coords(a, q), grid3d_coords(b, q)
        differ = [x for x in SUB_AXES_3D if ca[x] != cb[x]]
        shared = [x for x in SUB_AXES_3D if any({ranks[a], ranks[b]} <= set(g) for g in groups[x])]
        assert shared == (differ if len(differ) == 1 else [])


def test_coords_are_mixed_radix_input_fastest():
    assert grid3d_coords(0, 2) == {"input": 0, "weight": 0, "output": 0}
    assert grid3d_coords(1, 2) == {"input": 1, "weight": 0, "output": 0}
    assert grid3d_coords(2, 2) == {"input": 0, "weight": 1, "output": 0}
    assert grid3d_coords(4, 2) == {"input": 0, "weight": 0, "output": 1}
    assert grid3d_coords(26, 3) == {"input": 2, "weight": 2, "output": 2}


@pytest.mark.parametrize("ranks,q", [(list(range(4)), 2), (list(range(8)), 3), ([], 0)])
def test_wrong_count_is_one_line(ranks, q):
    with pytest.raises(ValueError, match=r"^3D tensor parallelism needs q\^3 ranks: got") as err:
        grid3d_groups(ranks, q)
    assert "\n" not in str(err.value)


def test_layout_blocks():
    g = Groups3D.of({"input": "gi", "weight": "gw", "output": "go"}, 2, 5)  # input 1, output 1
    assert (g.input_rank, g.weight_rank, g.output_rank) == (1, 0, 1)
    assert g.hidden_group("residual") == "go" and g.hidden_group("inner") == "gi"
    assert g.row_group("residual") == "gi" and g.row_group("inner") == "go"
    assert g.batch_block("residual") == 1 and g.batch_block("inner") == 1
    g = Groups3D.of({"input": None, "weight": None, "output": None}, 2, 6)  # weight 1, output 1
    assert g.batch_block("residual") == 2 and g.batch_block("inner") == 3
    assert g.hidden_rank("residual") == 1 and g.hidden_rank("inner") == 0
    assert other_layout("residual") == "inner" and other_layout("inner") == "residual"
    with pytest.raises(ValueError, match="layout 'rows' must be one of residual, inner"):
        g.hidden_group("rows")
    assert Groups3D.single().batch_block("inner") == 0


def test_first_copy_of_a_replicated_parameter():
    class P:
        tp3d_replicated_over = ("input", "weight")

    at = lambda t: Groups3D.of({"input": None, "weight": None, "output": None}, 2, t)
    assert [at(t).holds_first_copy(P) for t in range(8)] == [t in (0, 4) for t in range(8)]
    P.tp3d_replicated_over = ()
    assert all(at(t).holds_first_copy(P) for t in range(8))
    assert Groups3D.hidden_axis("residual") == "output" and Groups3D.row_axis("inner") == "output"

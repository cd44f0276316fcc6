"""The grid inside the tensor group (2d, 2.5d): its sub-axis groups by hand, the refusals of sizes
that are no grid, and the groups built on ranks (``ps.group("tp_row")``, ...; the repr)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from megalite.core.mesh_layout import mesh_sizes, tp_grid_groups, tp_grid_side
from megalite.core.parallel_state import all_group_ranks
from tests.harness import run_distributed
from tests.mesh import mesh

# tp_rank = col + q (row + q depth); a group over an axis: ranks differing only in its coordinate
WORLD8_TP4_2D_PP2 = {  # two tensor groups [0..3], [4..7] of 2 x 2
    ("tp_col",): [[0, 1], [2, 3], [4, 5], [6, 7]],
    ("tp_row",): [[0, 2], [1, 3], [4, 6], [5, 7]],
    ("tp_depth",): [[r] for r in range(8)],
    ("tp_row", "tp_depth"): [[0, 2], [1, 3], [4, 6], [5, 7]],
}
WORLD8_TP8_25D = {  # one tensor group of depth 2 x 2 x 2
    ("tp_col",): [[0, 1], [2, 3], [4, 5], [6, 7]],
    ("tp_row",): [[0, 2], [1, 3], [4, 6], [5, 7]],
    ("tp_depth",): [[0, 4], [1, 5], [2, 6], [3, 7]],
    ("tp_row", "tp_depth"): [[0, 2, 4, 6], [1, 3, 5, 7]],
}


def test_grid_groups_by_hand():
    sizes = mesh_sizes(
        8, tensor_model_parallel_size=4, pipeline_model_parallel_size=2, tensor_parallel_mode="2d"
    )
    groups = all_group_ranks(sizes)
    for axes, expected in WORLD8_TP4_2D_PP2.items():
        assert groups[frozenset(axes)] == expected, axes
    sizes = mesh_sizes(
        8, tensor_model_parallel_size=8, tensor_parallel_mode="2.5d", tensor_parallel_depth=2
    )
    groups = all_group_ranks(sizes)
    for axes, expected in WORLD8_TP8_25D.items():
        assert groups[frozenset(axes)] == expected, axes
    assert frozenset({"tp_row"}) not in all_group_ranks(mesh_sizes(8, tensor_model_parallel_size=4))


@pytest.mark.parametrize("mode, depth, q", [("2d", 1, 3), ("2.5d", 2, 2), ("2.5d", 3, 2)])
def test_every_grid_cell_is_one_rank_of_each_group(mode, depth, q):
    """A 3 x 3 and deeper grids: each sub-axis partitions the tensor group into groups of its size,
    and a rank's coordinates read back from its position in its col, row and depth groups."""
    ranks = list(range(100, 100 + depth * q * q))
    groups = tp_grid_groups(ranks, mode, depth)
    expect = {
        ("tp_col",): q,
        ("tp_row",): q,
        ("tp_depth",): depth,
        ("tp_row", "tp_depth"): q * depth,
    }
    for axes, size in expect.items():
        assert sorted(r for g in groups[axes] for r in g) == ranks
        assert {len(g) for g in groups[axes]} == {size}
    for t, rank in enumerate(ranks):
        where = {
            a[0]: next(g.index(rank) for g in groups[a] if rank in g) for a in expect if len(a) == 1
        }
        assert t == where["tp_col"] + q * (where["tp_row"] + q * where["tp_depth"])


@pytest.mark.parametrize(
    "tp, mode, depth, match",
    [
        (
            6,
            "2d",
            1,
            r"tensor_model_parallel_size 6 is not q x q for tensor_parallel_mode 2d; "
            r"use one of 1, 4, 9",
        ),
        (8, "2.5d", 3, r"tensor_model_parallel_size 8 is not depth 3 x q x q .*use one of 3, 12"),
        (4, "3d", 1, r"tensor_model_parallel_size 4 is not q x q x q .*use one of 1, 8, 27"),
        (4, "2d", 2, r"tensor_parallel_depth 2 applies to tensor_parallel_mode 2.5d only"),
        (4, "2x", 1, r"tensor_parallel_mode must be one of 1d, 2d, 2.5d, 3d, got '2x'"),
        (4, "2.5d", 0, r"tensor_parallel_depth must be an integer >= 1, got 0"),
    ],
)
def test_sizes_that_are_no_grid_are_refused_in_one_line(tp, mode, depth, match):
    with pytest.raises(ValueError, match=match) as err:
        tp_grid_side(tp, mode, depth)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=match):
        mesh_sizes(
            tp,
            tensor_model_parallel_size=tp,
            tensor_parallel_mode=mode,
            tensor_parallel_depth=depth,
        )


def _grid_case(tp, pp, mode, depth):
    ps = mesh(tp, pp, mode=mode, depth=depth)
    axes = [("tp_col",), ("tp_row",), ("tp_depth",), ("tp_row", "tp_depth")]
    out = {a: sorted(dist.get_process_group_ranks(ps.group(*a))) for a in axes if ps.size(*a) > 1}
    out["sizes"] = {a: ps.size(*a) for a in axes}
    out["repr"] = repr(ps)
    return out


def test_grid_groups_built_on_8_ranks():
    for rank, got in enumerate(run_distributed(_grid_case, 8, 8, 1, "2.5d", 2)):
        for axes, groups in WORLD8_TP8_25D.items():
            assert got[axes] == next(g for g in groups if rank in g), (rank, axes)
        assert got["repr"].endswith("tp mode 2.5d (depth 2 x row 2 x col 2))")
    for rank, got in enumerate(run_distributed(_grid_case, 8, 4, 2, "2d", 1)):
        assert got["sizes"][("tp_depth",)] == 1
        for axes in [("tp_col",), ("tp_row",), ("tp_row", "tp_depth")]:
            assert got[axes] == next(g for g in WORLD8_TP4_2D_PP2[axes] if rank in g)


# 3d: tp_rank = input + q (weight + q output); two tensor groups [0..7], [8..15] of 2 x 2 x 2
WORLD16_TP8_3D_PP2 = {
    ("tp_input",): [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]],
    ("tp_weight",): [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]],
    ("tp_output",): [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]],
}


def test_cube_groups_by_hand():
    sizes = mesh_sizes(
        16, tensor_model_parallel_size=8, pipeline_model_parallel_size=2, tensor_parallel_mode="3d"
    )
    groups = all_group_ranks(sizes)
    for axes, expected in WORLD16_TP8_3D_PP2.items():
        assert groups[frozenset(axes)] == expected, axes
    assert frozenset({"tp_row"}) not in groups


def _cube_case():
    ps = mesh(8, mode="3d")
    axes = ["tp_input", "tp_weight", "tp_output"]
    return {a: sorted(dist.get_process_group_ranks(ps.group(a))) for a in axes}, repr(ps)


def test_cube_groups_built_on_8_ranks():
    for rank, (got, text) in enumerate(run_distributed(_cube_case, 8)):
        for (axis,), groups in WORLD16_TP8_3D_PP2.items():
            assert got[axis] == next(g for g in groups if rank in g), (rank, axis)
        assert text.endswith("tp mode 3d (output 2 x weight 2 x input 2))")

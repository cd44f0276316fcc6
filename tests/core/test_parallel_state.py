"""The mesh: membership by hand for one layout, the rank-order equation for all, bad inputs."""

from __future__ import annotations

import itertools

import pytest
import torch.distributed as dist

from megalite.core.parallel_state import (
    coords_to_rank,
    initialize_model_parallel,
    mesh_group_ranks,
    rank_to_coords,
    validate_parallel_sizes,
)
from tests.harness import run_distributed

# world 8, tp=2, pp=2 -> dp=2; rank = pp*4 + dp*2 + tp. Written out by hand.
HAND_TABLE = {
    "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
    "dp": [[0, 2], [1, 3], [4, 6], [5, 7]],
    "pp": [[0, 4], [1, 5], [2, 6], [3, 7]],
    "mp": [[0, 1, 4, 5], [2, 3, 6, 7]],
    "embedding": [[0, 4], [1, 5], [2, 6], [3, 7]],
}


def _canon(groups):
    return sorted(sorted(g) for g in groups)


def test_tp2_pp2_world8_membership_by_hand():
    ranks = mesh_group_ranks(8, 2, 2)
    for axis, expected in HAND_TABLE.items():
        assert _canon(ranks[axis]) == _canon(expected), axis


@pytest.mark.parametrize(
    "tp,pp,dp",
    [(t, p, d) for t, p, d in itertools.product([1, 2, 4, 8], repeat=3) if t * p * d <= 8],
)
def test_every_layout_obeys_the_rank_order_equation(tp, pp, dp):
    world = tp * pp * dp
    ranks = mesh_group_ranks(world, tp, pp)
    for r in range(world):
        t, d, p = rank_to_coords(r, tp_size=tp, dp_size=dp)
        assert r == p * (dp * tp) + d * tp + t
        assert coords_to_rank(t, d, p, tp_size=tp, dp_size=dp) == r
        (tp_g,) = [g for g in ranks["tp"] if r in g]
        (dp_g,) = [g for g in ranks["dp"] if r in g]
        (pp_g,) = [g for g in ranks["pp"] if r in g]
        (mp_g,) = [g for g in ranks["mp"] if r in g]
        assert tp_g == [p * dp * tp + d * tp + i for i in range(tp)]
        assert dp_g == [p * dp * tp + i * tp + t for i in range(dp)]
        assert pp_g == [i * dp * tp + d * tp + t for i in range(pp)]
        assert sorted(mp_g) == sorted(
            i * dp * tp + d * tp + j for i in range(pp) for j in range(tp)
        )
    # each axis partitions the world
    for axis in ("tp", "dp", "pp", "mp"):
        flat = sorted(x for g in ranks[axis] for x in g)
        assert flat == list(range(world)), axis


@pytest.mark.parametrize(
    "world,tp,pp,match",
    [
        (8, 3, 1, r"world size 8 is not divisible by --tensor-model-parallel-size 3 x "),
        (6, 2, 2, r"world size 6 .* = 4"),
        (4, 0, 1, r"--tensor-model-parallel-size must be an integer >= 1, got 0"),
        (4, 1, -2, r"--pipeline-model-parallel-size must be an integer >= 1, got -2"),
    ],
)
def test_invalid_sizes_are_refused_with_the_numbers(world, tp, pp, match):
    with pytest.raises(ValueError, match=match):
        validate_parallel_sizes(world, tp, pp)


def _state_on_ranks(tp, pp):
    ps = initialize_model_parallel(tp, pp)

    def members(group):
        return sorted(dist.get_process_group_ranks(group))

    out = {
        "coords": (ps.tp_rank, ps.dp_rank, ps.pp_rank),
        "tp": members(ps.tp_group),
        "dp": members(ps.dp_group),
        "pp": members(ps.pp_group),
        "mp": members(ps.mp_group),
        "embedding": members(ps.embedding_group),
        "first_last": (ps.is_first_stage, ps.is_last_stage),
        "prev_next": (ps.prev_rank, ps.next_rank),
    }
    # the groups really connect their members
    import torch

    t = torch.ones(1)
    dist.all_reduce(t, group=ps.tp_group)
    out["tp_sum"] = t.item()
    return out


def test_groups_built_on_8_ranks_match_the_table():
    states = run_distributed(_state_on_ranks, 8, 2, 2)
    for rank, s in enumerate(states):
        for axis, groups in HAND_TABLE.items():
            (mine,) = [g for g in groups if rank in g]
            assert s[axis] == sorted(mine), (rank, axis)
        pp_rank = rank // 4
        assert s["coords"] == (rank % 2, (rank // 2) % 2, pp_rank)
        assert s["first_last"] == (pp_rank == 0, pp_rank == 1)
        assert s["prev_next"] == ((None, rank + 4) if pp_rank == 0 else (rank - 4, None))
        assert s["tp_sum"] == 2.0


def _pp4_state():
    ps = initialize_model_parallel(1, 4)
    emb = sorted(dist.get_process_group_ranks(ps.embedding_group)) if ps.embedding_group else None
    return ps.pp_rank, ps.is_in_embedding_group, ps.embedding_ranks, emb, ps.prev_rank, ps.next_rank


def test_pp4_middle_stages_are_outside_the_embedding_group():
    states = run_distributed(_pp4_state, 4)
    assert states == [
        (0, True, [0, 3], [0, 3], None, 1),
        (1, False, [0, 3], None, 0, 2),
        (2, False, [0, 3], None, 1, 3),
        (3, True, [0, 3], [0, 3], 2, None),
    ]


def _refuse_bad_world():
    initialize_model_parallel(3, 1)


def test_bad_world_refused_before_any_group():
    with pytest.raises(AssertionError, match=r"world size 4 is not divisible by"):
        run_distributed(_refuse_bad_world, 4)

"""The mesh on ranks: membership by hand for one layout, the rank-order equation for all TP x PP x
DP, the named-axes API (any combination, both views) on real process groups, bad inputs.
The pure layout (every size combination, Megatron's generator) is tests/core/test_mesh_layout.py."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from megalite.core.mesh_layout import mesh_sizes, rank_coords
from megalite.core.parallel_state import (
    all_group_ranks,
    embedding_group_ranks,
    initialize_model_parallel,
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


def mesh_group_ranks(world_size: int, tp_size: int, pp_size: int) -> dict[str, list[list[int]]]:
    """The groups of the TP x DP x PP axes (and mp, embedding) through the generic builder."""
    sizes = mesh_sizes(
        world_size, tensor_model_parallel_size=tp_size, pipeline_model_parallel_size=pp_size
    )
    groups = all_group_ranks(sizes)
    out = {axis: groups[frozenset({axis})] for axis in ("tp", "dp", "pp")}
    out["mp"] = groups[frozenset({"tp", "pp"})]
    out["embedding"] = embedding_group_ranks(out["pp"])
    return out


def rank_to_coords(rank: int, *, tp_size: int, dp_size: int, pp_size: int):
    c = rank_coords(rank, {"tp": tp_size, "dp": dp_size, "pp": pp_size}, "tp-cp-ep-dp-pp")
    return c["tp"], c["dp"], c["pp"]


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
        t, d, p = rank_to_coords(r, tp_size=tp, dp_size=dp, pp_size=pp)
        assert r == p * (dp * tp) + d * tp + t
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
    with pytest.raises(
        AssertionError, match=r"world size 4 is not divisible by tensor_model_parallel_size"
    ):
        run_distributed(_refuse_bad_world, 4)


def _named_axes_case():
    ps = initialize_model_parallel(2, 2, context_parallel_size=2)  # world 8: tp2 cp2 dp1 pp2

    def members(*axes):
        return sorted(dist.get_process_group_ranks(ps.group(*axes)))

    t = torch.ones(1)
    dist.all_reduce(t, group=ps.group("dp", "cp"))
    out = {
        axes: (members(*axes), ps.size(*axes), ps.rank(*axes), ps.ranks(*axes))
        for axes in [("tp",), ("cp",), ("dp", "cp"), ("cp", "dp"), ("tp", "cp"), ("tp", "pp")]
    }
    out["world"] = (ps.size(), ps.rank(), ps.group() is dist.group.WORLD)
    out["sum"] = t.item()
    try:
        ps.group("tp", "dp", "pp")
    except ValueError as e:
        out["error"] = str(e)
    ps.destroy()
    return out


def test_named_axes_on_8_ranks():
    """tp2 cp2 dp1 pp2: rank = tp + 2 cp + 4 pp. The (dp, cp) group is the cp group here."""
    for rank, s in enumerate(run_distributed(_named_axes_case, 8)):
        tp, cp, pp = rank % 2, (rank // 2) % 2, rank // 4
        cp_group = [pp * 4 + tp, pp * 4 + 2 + tp]
        tp_group = [pp * 4 + cp * 2, pp * 4 + cp * 2 + 1]
        tp_cp_group = list(range(pp * 4, pp * 4 + 4))
        assert s[("tp",)] == (tp_group, 2, tp, tp_group)
        assert s[("cp",)] == (cp_group, 2, cp, cp_group)
        assert s[("dp", "cp")] == s[("cp", "dp")] == (cp_group, 2, cp, cp_group)
        assert s[("tp", "cp")] == (tp_cp_group, 4, tp + 2 * cp, tp_cp_group)
        mp = [cp * 2, cp * 2 + 1, 4 + cp * 2, 5 + cp * 2]
        assert s[("tp", "pp")] == (mp, 4, tp + 2 * pp, mp)
        assert s["world"] == (8, rank, True)
        assert s["sum"] == 2.0
        assert s["error"].startswith("no process group over axes ('tp', 'dp', 'pp'); built: ")


def _expert_case():
    ps = initialize_model_parallel(
        2, 1, expert_model_parallel_size=2, expert_tensor_parallel_size=1
    )
    out = {a: sorted(dist.get_process_group_ranks(ps.group(a))) for a in ("ep", "edp", "etp")}
    out["dense_dp"] = sorted(dist.get_process_group_ranks(ps.dp_group))
    ps.destroy()
    return out


def test_expert_view_on_4_ranks():
    """world 4, tp2 (dense: dp 2), ep2 etp1 (expert: edp 2): expert rank = ep + 2 edp."""
    for rank, s in enumerate(run_distributed(_expert_case, 4)):
        assert s["ep"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert s["edp"] == [rank % 2, rank % 2 + 2]
        assert s["etp"] == [rank]
        assert s["dense_dp"] == [rank % 2, rank % 2 + 2]

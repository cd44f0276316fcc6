"""The rank layout (pure): hand-written tables, the rank-order equation on every layout of at most
64 ranks in two orders, Megatron-core's RankGenerator (committed fixtures, dense and expert view),
the layouts whose views would not share the pipeline groups refused, bad sizes."""

from __future__ import annotations

import hashlib
import itertools
import json
from math import prod

import numpy as np
import pytest

from megalite.core.mesh_layout import (
    MeshSizes,
    dense_or_expert,
    mesh_sizes,
    rank_coords,
    rank_groups,
)
from megalite.core.parallel_state import all_group_ranks
from tests import paths

FIXTURE = str(paths.FIXTURES / "megatron_rank_groups.json")
EXPERT_FIXTURE = str(paths.FIXTURES / "megatron_expert_rank_groups.json")
# Megatron's expert generator tokens -> megalite's expert axes
EXPERT_TOKENS = {
    "tp": ("etp",),
    "ep": ("ep",),
    "dp": ("edp",),
    "tp-ep": ("etp", "ep"),
    "tp-ep-pp": ("etp", "ep", "pp"),
}
AXES = ("tp", "cp", "ep", "dp", "pp")
ORDERS = ("tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp")
TOKENS = ("tp", "cp", "ep", "dp", "pp", "tp-cp", "dp-cp", "tp-pp", "tp-dp-cp", "tp-ep", "tp-ep-pp")


def _canon(groups):
    return sorted(sorted(g) for g in groups)


# world 16, tp2 cp2 dp2 pp2, order tp-cp-ep-dp-pp: rank = tp + 2 cp + 4 dp + 8 pp. By hand.
WORLD16 = {
    ("tp",): [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]],
    ("cp",): [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]],
    ("dp",): [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]],
    ("pp",): [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]],
    ("dp", "cp"): [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]],
    ("tp", "cp"): [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]],
    ("tp", "pp"): [[0, 1, 8, 9], [2, 3, 10, 11], [4, 5, 12, 13], [6, 7, 14, 15]],
}

# world 8, tp2, ep2, etp1, pp1: dense rank = tp + 2 dp (dp 4); expert rank = ep + 2 edp (edp 4).
WORLD8_EXPERT = {
    ("tp",): [[0, 1], [2, 3], [4, 5], [6, 7]],
    ("dp",): [[0, 2, 4, 6], [1, 3, 5, 7]],
    ("etp",): [[r] for r in range(8)],
    ("ep",): [[0, 1], [2, 3], [4, 5], [6, 7]],
    ("edp",): [[0, 2, 4, 6], [1, 3, 5, 7]],
    ("etp", "ep"): [[0, 1], [2, 3], [4, 5], [6, 7]],
    ("pp",): [[r] for r in range(8)],
}


def test_world16_tp2_cp2_dp2_pp2_by_hand():
    sizes = mesh_sizes(
        16, tensor_model_parallel_size=2, context_parallel_size=2, pipeline_model_parallel_size=2
    )
    groups = all_group_ranks(sizes)
    for axes, expected in WORLD16.items():
        assert groups[frozenset(axes)] == expected, axes


def test_expert_view_world8_tp2_ep2_etp1_by_hand():
    sizes = mesh_sizes(
        8, tensor_model_parallel_size=2, expert_model_parallel_size=2, expert_tensor_parallel_size=1
    )
    assert (sizes.dp, sizes.edp) == (4, 4)
    groups = all_group_ranks(sizes)
    for axes, expected in WORLD8_EXPERT.items():
        assert groups[frozenset(axes)] == expected, axes


def test_the_views_share_only_the_pipeline_groups():
    sizes = mesh_sizes(
        16,
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        expert_model_parallel_size=4,
        expert_tensor_parallel_size=1,
    )
    groups = all_group_ranks(sizes)
    dense_pp = rank_groups(16, sizes.dense(), sizes.order, ["pp"])
    expert_pp = rank_groups(16, sizes.expert(), sizes.order, ["pp"])
    assert dense_pp == expert_pp == groups[frozenset({"pp"})]
    assert _canon(groups[frozenset({"ep"})]) == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [8, 9, 10, 11],
        [12, 13, 14, 15],
    ]


def _layouts(limit: int = 64):
    def rec(k, bound):
        if k == 0:
            yield ()
            return
        for x in range(1, bound + 1):
            for rest in rec(k - 1, bound // x):
                yield (x, *rest)

    return list(rec(5, limit))


def _place_values(radix: list[int]) -> np.ndarray:
    """The place value of each digit of a mixed-radix number, the first digit counting fastest."""
    return np.array([prod(radix[:i]) for i in range(len(radix))], dtype=np.int64)


def _check_equation(sizes: dict[str, int], order: str) -> None:
    """Every group of every token = the ranks that agree on the other axes' digits, with members
    in mixed-radix order of the token's digits and groups in mixed-radix order of the other
    digits (the rank equation of DESIGN §2): the whole list is built from ``rank_coords`` by
    placing each rank at [its other digits' number, its token digits' number]."""
    names = order.split("-")
    world = prod(sizes.values())
    radix = [sizes[a] for a in names]
    coords = np.array([list(rank_coords(r, sizes, order).values()) for r in range(world)])
    assert ((coords >= 0) & (coords < radix)).all(), (sizes, order)
    assert (coords @ _place_values(radix) == np.arange(world)).all(), (sizes, order)
    for token in TOKENS:
        axes = token.split("-")
        inside = [i for i, a in enumerate(names) if a in axes]
        outside = [i for i, a in enumerate(names) if a not in axes]
        member = coords[:, inside] @ _place_values([radix[i] for i in inside])
        group = coords[:, outside] @ _place_values([radix[i] for i in outside])
        size = prod(radix[i] for i in inside)
        expected = np.full((world // size, size), -1)
        expected[group, member] = np.arange(world)
        got = rank_groups(world, sizes, order, axes)
        assert got == expected.tolist(), (sizes, order, token, got)


@pytest.mark.parametrize("order", ORDERS)
def test_rank_groups_obey_the_rank_equation_on_every_layout_up_to_64(order):
    layouts = _layouts()
    assert len(layouts) == 3652  # every (tp, cp, ep, dp, pp) with product <= 64
    for t in layouts:
        _check_equation(dict(zip(AXES, t)), order)


def test_rank_groups_are_what_megatron_core_builds():
    """Digests written by tools/megatron_rank_groups.py from megatron-core 0.16.1's
    RankGenerator, for sizes in {1, 2, 3, 4, 8} up to 64 ranks, both orders, 11 tokens."""
    with open(FIXTURE) as f:
        expected = json.load(f)
    assert len(expected) == 1082
    for key, digest in expected.items():
        order, sizes_text = key.split("|")
        sizes = {part[:2]: int(part[2:]) for part in sizes_text.split(",")}
        world = prod(sizes.values())
        ours = {t: rank_groups(world, sizes, order, t.split("-")) for t in TOKENS}
        text = json.dumps(ours, sort_keys=True).encode()
        assert hashlib.sha256(text).hexdigest()[:16] == digest, key


def _expert_layouts(world: int):
    """(tp, cp, dp, pp, ep, etp) of ``world``, EP and ETP in {1, 2, 4}, the expert view factoring
    the world (written apart from the fixture tool's enumeration; the counts must agree)."""
    divisors = [d for d in range(1, world + 1) if world % d == 0]  # each factor of tp cp dp
    for tp, cp, dp in itertools.product(divisors, repeat=3):
        if world % (tp * cp * dp):
            continue
        pp = world // (tp * cp * dp)
        for ep, etp in itertools.product((1, 2, 4), repeat=2):
            if world % (etp * ep * pp) == 0:
                yield tp, cp, dp, pp, ep, etp


def _expert_records(world: int, order: str) -> dict[str, list]:
    """Per layout: [whether mesh_sizes accepts it, the expert groups megalite builds]."""
    records = {}
    for tp, cp, dp, pp, ep, etp in _expert_layouts(world):
        try:
            mesh_sizes(
                world,
                tensor_model_parallel_size=tp,
                context_parallel_size=cp,
                pipeline_model_parallel_size=pp,
                expert_model_parallel_size=ep,
                expert_tensor_parallel_size=etp,
                order=order,
            )
            accepted = True
        except ValueError as e:
            assert "splits pipeline stages" in str(e) and "\n" not in str(e), str(e)
            accepted = False
        sizes = MeshSizes(world, tp=tp, cp=cp, pp=pp, ep=ep, etp=etp, order=order)
        groups = {}  # the expert combinations as all_group_ranks builds them
        for token, axes in EXPERT_TOKENS.items():
            view, digits = dense_or_expert(axes)
            assert view == "expert"
            groups[token] = rank_groups(world, sizes.expert(), order, digits)
        groups["pp"] = rank_groups(world, sizes.expert(), order, ["pp"])
        dense_pp = rank_groups(world, sizes.dense(), order, ["pp"])
        # refused exactly when the views' pipeline groups differ
        assert accepted == (groups["pp"] == dense_pp), (order, tp, cp, dp, pp, ep, etp)
        records[",".join(map(str, (tp, cp, dp, pp, ep, etp)))] = [accepted, groups]
    return records


@pytest.mark.parametrize("order", ORDERS)
def test_expert_view_is_megatron_cores_and_never_splits_pipeline_stages(order):
    """Every layout up to 64 ranks, EP and ETP in {1, 2, 4}: megalite refuses exactly the
    layouts Megatron-core's initialize_model_parallel asserts against (dense and expert pipeline
    groups differ), and its expert groups are RankGenerator(tp=etp, ep, dp=edp, pp)'s (digests
    per world written by tools/megatron_rank_groups.py from megatron-core 0.16.1)."""
    with open(EXPERT_FIXTURE) as f:
        expected = json.load(f)
    refused = 0
    for world in range(1, 65):
        records = _expert_records(world, order)
        want = expected[f"{order}|{world}"]
        text = json.dumps(records, sort_keys=True).encode()
        got_refused = sum(1 for accepted, _ in records.values() if not accepted)
        assert (len(records), got_refused) == (want["layouts"], want["refused"]), (order, world)
        assert hashlib.sha256(text).hexdigest()[:16] == want["digest"], (order, world)
        refused += got_refused
    # pp last: the views always share the pipelines; tp-cp-ep-pp-dp refuses thousands
    assert (refused == 0) == (order == "tp-cp-ep-dp-pp"), refused


def test_world4_pp2_ep2_in_tp_pp_dp_order_is_refused_in_one_line():
    with pytest.raises(ValueError) as e:
        mesh_sizes(4, pipeline_model_parallel_size=2, expert_model_parallel_size=2, order=ORDERS[1])
    assert str(e.value) == (
        "rank order tp-cp-ep-pp-dp with pipeline_model_parallel_size 2 splits pipeline stages: "
        "they are tensor_model_parallel_size 1 x context_parallel_size 1 = 1 ranks apart in the "
        "dense view but expert_tensor_parallel_size 1 x expert_model_parallel_size 2 = 2 in the "
        "expert view, so an expert group would span two stages; make the two products equal or "
        "put pp last (order tp-cp-ep-dp-pp)"
    )
    # CP 2 restores the stride: both views' pipelines are [[0, 2], [1, 3]]
    sizes = mesh_sizes(
        4,
        context_parallel_size=2,
        pipeline_model_parallel_size=2,
        expert_model_parallel_size=2,
        order=ORDERS[1],
    )
    assert rank_groups(4, sizes.expert(), sizes.order, ["pp"]) == [[0, 2], [1, 3]]
    assert all_group_ranks(sizes)[frozenset({"pp"})] == [[0, 2], [1, 3]]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (
            {"world_size": 8, "tensor_model_parallel_size": 3},
            r"world size 8 is not divisible by tensor_model_parallel_size x "
            r"context_parallel_size x pipeline_model_parallel_size = 3 x 1 x 1 = 3",
        ),
        (
            {"world_size": 6, "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2},
            r"world size 6 .* = 2 x 1 x 2 = 4",
        ),
        (
            {"world_size": 8, "context_parallel_size": 2, "pipeline_model_parallel_size": 3},
            r"world size 8 .* = 1 x 2 x 3 = 6",
        ),
        (
            {"world_size": 8, "expert_model_parallel_size": 3},
            r"world size 8 is not divisible by expert_tensor_parallel_size x "
            r"expert_model_parallel_size x pipeline_model_parallel_size = 1 x 3 x 1 = 3",
        ),
        (
            {"world_size": 4, "tensor_model_parallel_size": 0},
            r"tensor_model_parallel_size must be an integer >= 1, got 0",
        ),
        (
            {"world_size": 4, "pipeline_model_parallel_size": -2},
            r"pipeline_model_parallel_size must be an integer >= 1, got -2",
        ),
        (
            {"world_size": 4, "context_parallel_size": 2, "order": "tp-ep-dp-pp"},
            r"order 'tp-ep-dp-pp' leaves out axis 'cp' whose size is 2",
        ),
        (
            {"world_size": 4, "order": "tp-tp-dp-pp"},
            r"must name each of tp-cp-ep-dp-pp at most once",
        ),
    ],
)
def test_invalid_sizes_are_refused_with_the_numbers(kwargs, match):
    world = kwargs.pop("world_size")
    with pytest.raises(ValueError, match=match):
        mesh_sizes(world, **kwargs)


def test_mixing_the_views_is_refused():
    with pytest.raises(ValueError, match=r"mix the dense view .* and the expert view"):
        dense_or_expert(("tp", "ep"))
    assert dense_or_expert(("etp", "ep", "pp")) == ("expert", ["tp", "ep", "pp"])

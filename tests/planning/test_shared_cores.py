"""The shared-core replay of a pipeline's action lists (``planning.shared_cores``): with a core per
rank it is the core simulator's replay, on every schedule; with fewer cores the ranks that compute
share them, and a rank waiting in the bubble lends its core."""

from __future__ import annotations

import pytest

from megalite.core.pipeline_parallel.actions import with_p2p
from megalite.core.pipeline_parallel.generators import SCHEDULES, generate, layout_of
from megalite.core.pipeline_parallel.simulator import Costs, simulate
from megalite.planning.shared_cores import replay

UNEVEN = {"F": [1.0, 1.3, 0.7, 1.1], "I": [0.9, 1.2, 0.8, 1.0], "W": [0.6, 0.5, 0.7, 0.4]}


def _lists(schedule: str, p: int = 4, m: int = 8):
    v = 2 if schedule in ("interleaved-1f1b", "zbv", "dualpipev") else 1
    layout = layout_of(schedule, p, v)
    return generate(schedule, pp_size=p, num_microbatches=m, num_chunks=v), layout


def _cost(layout, factor=1.0):
    def cost(rank, a):
        s = layout.stage(rank, a.chunk) % 4
        if a.op == "B":
            return factor * (UNEVEN["I"][s] + UNEVEN["W"][s])
        return factor * UNEVEN[a.op][s]

    return cost


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_core_per_rank_is_the_core_simulator(schedule):
    compute, layout = _lists(schedule)
    cost = _cost(layout)
    makespan, work = replay(compute, layout, cost, p2p=0.05, cores=4)

    # the core simulator with the same per-(rank, chunk) costs: one Costs per rank's view
    sim_lists = with_p2p(compute, layout)
    table = {}
    for r, actions in enumerate(compute):
        for a in actions:
            table[(r, a.chunk, a.op)] = cost(r, a)

    # the simulator asks costs without the rank: ranks differ here, so tag each list's chunks
    from megalite.core.pipeline_parallel.actions import Action
    from megalite.planning.step_time import _RankChunk

    tagged = [[Action(a.op, a.microbatch, _RankChunk(a.chunk, r)) for a in acts]
              for r, acts in enumerate(sim_lists)]  # fmt: skip

    class Tagged(Costs):
        def of(self, op, chunk):
            return table.get((chunk.rank, int(chunk), op), 0.0)

    sim = simulate(tagged, layout, Tagged(p2p=0.05))
    assert makespan == pytest.approx(sim.step_time, rel=1e-9)
    assert work == pytest.approx(sim.busy, rel=1e-9)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb-h1"])
def test_fewer_cores_share_the_work_and_fill_the_bubble(schedule):
    compute, layout = _lists(schedule)
    cost = _cost(layout)
    own, work = replay(compute, layout, cost, p2p=0.0, cores=4)
    one, _ = replay(compute, layout, cost, p2p=0.0, cores=1)
    assert one == pytest.approx(sum(work), rel=1e-9)  # one core: the ranks' work in a row
    two, _ = replay(compute, layout, cost, p2p=0.0, cores=2)
    assert sum(work) / 2 <= two + 1e-9 and two < 2 * own  # the bubble is lent, not lost
    # with a group of 2 processes per pipeline rank, 8 cores are a core each again
    assert replay(compute, layout, cost, p2p=0.0, cores=8, group=2)[0] == pytest.approx(own)

"""The simulator's cost of oversubscribed cores (``simulate(..., cores=c, oversubscribed=e)``):
while more ranks than cores are runnable each keeps ``e`` of its ``c / runnable`` share; while
they are no more than the cores nothing changes."""

from __future__ import annotations

import pytest

from megalite.core.pipeline_parallel.actions import with_p2p
from megalite.core.pipeline_parallel.generators import generate, layout_of
from megalite.core.pipeline_parallel.simulator import Costs, simulate

STAGES = [(1.0, 0.9, 0.6), (1.3, 1.2, 0.5), (0.7, 0.8, 0.7), (1.1, 1.0, 0.4)]  # (F, I, W)


def _case(schedule: str, m: int):
    layout = layout_of(schedule, 4, 1)
    return with_p2p(generate(schedule, pp_size=4, num_microbatches=m), layout), layout


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_oversubscribed_cores_slow_only_the_crowded_time(schedule):
    lists, layout = _case(schedule, 8)
    costs = Costs(stages=STAGES)
    work = sum(simulate(lists, layout, costs).busy)
    # one core: the ranks' work in a row, each unit at speed 1 alone and e = 0.5 when crowded
    ideal = simulate(lists, layout, costs, cores=1).step_time
    crowded = simulate(lists, layout, costs, cores=1, oversubscribed=0.5).step_time
    assert ideal == pytest.approx(work, rel=1e-9)
    assert work + 1e-6 < crowded < 2 * work  # crowded part of the time, alone part of it
    two = simulate(lists, layout, costs, cores=2, oversubscribed=0.5).step_time
    assert simulate(lists, layout, costs, cores=2).step_time + 1e-6 < two
    # 1F1B with one micro-batch: never more runnable ranks than cores, so unchanged
    one_mb, one_layout = _case("1f1b", 1)
    assert simulate(one_mb, one_layout, costs, cores=1, oversubscribed=0.5).step_time == (
        pytest.approx(simulate(one_mb, one_layout, costs, cores=1).step_time, rel=1e-9)
    )


def test_oversubscribed_outside_0_1_is_refused():
    lists, layout = _case("1f1b", 4)
    with pytest.raises(ValueError, match="oversubscribed must lie in"):
        simulate(lists, layout, Costs(stages=STAGES), cores=2, oversubscribed=0.0)

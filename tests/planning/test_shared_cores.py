"""The planner's CPU pipeline step: the core simulator with the ranks sharing the cores
(``simulate(..., cores=c)``, what ``step_time`` calls with ``cores / group``). With fewer cores than
ranks the ranks that compute share them, and a rank waiting in the bubble lends its core."""

from __future__ import annotations

import pytest

from megalite.core.pipeline_parallel.actions import with_p2p
from megalite.core.pipeline_parallel.generators import generate, layout_of
from megalite.core.pipeline_parallel.simulator import Costs, simulate

# per global stage (F, I, W): uneven, so a stage-blind replay would be caught
STAGES = [(1.0, 0.9, 0.6), (1.3, 1.2, 0.5), (0.7, 0.8, 0.7), (1.1, 1.0, 0.4)]


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb-h1"])
def test_fewer_cores_share_the_work_and_fill_the_bubble(schedule):
    layout = layout_of(schedule, 4, 1)
    lists = with_p2p(generate(schedule, pp_size=4, num_microbatches=8), layout)
    costs = Costs(stages=STAGES)
    own = simulate(lists, layout, costs)
    work = sum(own.busy)
    assert own.step_time > max(own.busy) + 1e-9  # a bubble, with a core per rank
    one = simulate(lists, layout, costs, cores=1).step_time
    assert one == pytest.approx(work, rel=1e-9)  # one core: the ranks' work in a row
    two = simulate(lists, layout, costs, cores=2).step_time
    assert work / 2 <= two + 1e-9 and two < 2 * own.step_time  # the bubble is lent, not lost
    assert simulate(lists, layout, costs, cores=4).step_time == pytest.approx(own.step_time)

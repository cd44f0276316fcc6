"""The backend's own CPU per message (``Costs.transfer_cpu``: gloo moves a message's bytes on a
thread of each end's process) in a replay on shared cores: work beside the ranks, from the send
until it is done, that takes its share of the cores; with a core per rank it is not charged."""

from __future__ import annotations

import dataclasses

import pytest

from megalite.core.pipeline_parallel.actions import with_p2p
from megalite.core.pipeline_parallel.generators import generate, layout_of
from megalite.core.pipeline_parallel.simulator import Costs, simulate


def _case(schedule: str, pp: int, m: int, v: int = 1):
    layout = layout_of(schedule, pp, v)
    lists = generate(schedule, pp_size=pp, num_microbatches=m, num_chunks=v)
    return with_p2p(lists, layout), layout


def test_one_core_runs_every_message_s_thread_work_too():
    """PP 2, one micro-batch, one core: F (1) on rank 0, its send's two ends (0.5 each) beside
    rank 1's F, then rank 1's B (2), the grad's two ends beside rank 0's B (2): nothing overlaps
    on one core, so the step is all the work, 6 of compute and 4 x 0.5 of messages."""
    lists, layout = _case("1f1b", 2, 1)
    costs = Costs(forward=1.0, backward_input=1.0, backward_weight=1.0, transfer_cpu=0.5)
    assert simulate(lists, layout, costs, cores=1).step_time == pytest.approx(8.0, rel=1e-9)
    zero = dataclasses.replace(costs, transfer_cpu=0.0)
    assert simulate(lists, layout, zero, cores=1).step_time == pytest.approx(6.0, rel=1e-9)
    # a core per rank: the backend's threads run on the cores of waiting ranks, not charged
    assert simulate(lists, layout, costs).step_time == pytest.approx(6.0, rel=1e-9)


@pytest.mark.parametrize(
    "schedule, v", [("1f1b", 1), ("interleaved-1f1b", 2), ("zbv", 2), ("dualpipev", 2)]
)
def test_shared_cores_pay_more_for_schedules_with_more_messages(schedule, v):
    """PP 4 on 2 cores: the step grows with the messages' thread work, by at most all of it
    (2 x transfer CPU per send)."""
    lists, layout = _case(schedule, 4, 8, v)
    stages = [(1.0, 0.9, 0.6)] * layout.num_stages
    costs = Costs(stages=stages, p2p=0.05, transfer_cpu=0.1)
    base = simulate(lists, layout, dataclasses.replace(costs, transfer_cpu=0.0), cores=2)
    charged = simulate(lists, layout, costs, cores=2)
    sends = sum(a.op in ("SEND_F", "SEND_B") for rank in lists for a in rank)
    thread_work = 2 * sends * costs.transfer_cpu
    assert base.step_time < charged.step_time <= base.step_time + thread_work + 1e-9

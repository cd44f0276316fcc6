"""Receives posted ahead on a tag-matched, op-by-op communicator (gloo): ``posting.receives_ahead``.

- The plan: for every schedule at PP 2 and 4, each receive sits exactly ``lead`` batches before
  the batch ``p2p_program`` put it in (in the rank's first batch at the earliest), every send and
  every compute action keeps its place, and nothing is lost or doubled; a receive stays ahead of
  the compute that consumes it.
- The executor: on gloo's default communicator (tags, op by op, overlap) the resolved plan is the
  moved one; without tags, without overlap or through ``batch_isend_irecv`` it is
  ``posting_plan``'s own order (nccl's pairing of batches, and waits right after posting, need
  it). With the receives ahead, GPipe and DualPipeV at PP 2 and 1F1B at PP 4 give the
  single-process oracle's grads (1e-5) over two steps; the other schedules are checked so in
  ``test_executor_hot_path.py``.
"""

from __future__ import annotations

import pytest
import torch

from megalite.core.pipeline_parallel.actions import Action, p2p_program, posting_plan
from megalite.core.pipeline_parallel.generators import SCHEDULES, generate, layout_of
from megalite.core.pipeline_parallel.posting import POST, RECEIVE_LEAD, plan_for, receives_ahead
from tests.core.pipeline_parallel.test_executor_hot_path import (
    TOL,
    _communicator,
    _oracle_grads,
    _setup,
    _step,
)
from tests.harness import run_distributed
from tests.mesh import mesh

V = {"interleaved-1f1b": 2, "zbv": 2, "dualpipev": 2}


def _items(plan: list) -> list[tuple]:
    """``posting_plan``'s list as ``Plan.items`` hold it: compute (code 0) or POST."""
    return [(0, x, ()) if isinstance(x, Action) else (POST, x, ()) for x in plan]


def _places(items: list[tuple]) -> tuple[list, dict, dict, list[int]]:
    """The compute actions in order; per send and per receive, the number of compute actions
    before its batch (where it sits between them) and its batch's index; per batch, the number
    of compute actions before it."""
    computes, sends, recvs, batches = [], {}, {}, []
    for code, item, _ in items:
        if code != POST:
            computes.append(item)
            continue
        for op in item:
            into = sends if op.send else recvs
            assert op not in into, op  # nothing doubled
            into[op] = (len(computes), len(batches))
        batches.append(len(computes))
    return computes, sends, recvs, batches


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("lead", [1, RECEIVE_LEAD])
def test_each_receive_moves_lead_batches_earlier_and_nothing_else_moves(schedule, pp, lead):
    v = V.get(schedule, 1)
    layout = layout_of(schedule, pp, v)
    programs = p2p_program(generate(schedule, pp_size=pp, num_microbatches=8, num_chunks=v), layout)
    for rank in range(pp):
        before = _items(posting_plan(programs[rank], layout, rank))
        computes, sends, recvs, batches = _places(before)
        computes_after, sends_after, recvs_after, _ = _places(receives_ahead(before, lead))
        assert computes_after == computes, rank
        assert {op: at for op, (at, _) in sends_after.items()} == {
            op: at for op, (at, _) in sends.items()
        }, rank
        assert set(recvs_after) == set(recvs) and recvs, rank
        for op, (_, k) in recvs.items():
            assert recvs_after[op][0] == batches[max(0, k - lead)], (rank, op)


def _plans_case(kwargs: dict) -> bool:
    ps = mesh(1, 2)
    layout = layout_of("1f1b", 2)
    p2p = _communicator(ps, **kwargs)
    program = tuple(
        p2p_program(generate("1f1b", pp_size=2, num_microbatches=4), layout)[ps.pp_rank]
    )
    got = [
        [op.message for op in item]
        for code, item, _ in plan_for(program, layout, ps.pp_rank, p2p).items
        if code == POST
    ]
    plain = [
        [(op.kind, op.microbatch, op.stage) for op in item]
        for item in posting_plan(program, layout, ps.pp_rank)
        if not isinstance(item, Action)
    ]
    return got == plain


@pytest.mark.parametrize(
    "kwargs, moved",
    [
        ({}, True),
        ({"tagged": False}, False),
        ({"overlap": False}, False),
        ({"batched": True}, False),
    ],
)
def test_the_executor_posts_receives_ahead_only_where_tags_match_them_op_by_op(kwargs, moved):
    for rank, same in enumerate(run_distributed(_plans_case, 2, kwargs)):
        assert same is (not moved), (rank, kwargs)


def _grads_case(schedule: str, v: int, pp: int) -> list:
    ps = mesh(1, pp)
    layout, chunks = _setup(schedule, v, ps, pp)
    p2p = _communicator(ps)
    bad = []
    for k in range(2):
        xs = torch.randn(4, 3, 8, generator=torch.Generator().manual_seed(20 + k))
        _step(schedule, chunks, p2p, ps, xs, pp)
        want = _oracle_grads(layout.num_stages, xs)
        for c, st in enumerate(chunks):
            for got, ref in zip(st.parameters(), want[layout.stage(ps.pp_rank, c)]):
                if not torch.allclose(got.grad, ref, **TOL):
                    bad.append((k, c, float((got.grad - ref).abs().max())))
    return bad


@pytest.mark.parametrize("schedule, v, pp", [("gpipe", 1, 2), ("dualpipev", 2, 2), ("1f1b", 1, 4)])
def test_receives_ahead_keep_the_oracles_grads(schedule, v, pp):
    for rank, bad in enumerate(run_distributed(_grads_case, pp, schedule, v, pp)):
        assert bad == [], (rank, bad)

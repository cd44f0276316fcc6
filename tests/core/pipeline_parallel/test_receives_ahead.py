"""Receives posted ahead on a tag-matched, op-by-op communicator (gloo): ``posting.receives_ahead``.

- The plan: for every schedule at PP 2 and 4, each receive sits exactly ``lead`` batches before
  the batch ``p2p_program`` put it in (in the rank's first batch at the earliest), every send and
  every compute action keeps its place, and nothing is lost or doubled; a receive stays ahead of
  the compute that consumes it.
- The executor: on gloo's default communicator (tags, op by op, overlap) the resolved plan is the
  moved one (by ``RECEIVE_LEAD``, or the communicator's ``receive_lead``); without tags, without
  overlap or through ``batch_isend_irecv`` it is ``posting_plan``'s own order (nccl's pairing of
  batches, and waits right after posting, need it), and a lead asked of such a communicator is a
  one-line ValueError.
- With the receives ahead, GPipe and DualPipeV at PP 2 and 1F1B at PP 4 give the single-process
  oracle's grads (1e-5) over two steps; the other schedules are checked so in
  ``test_executor_hot_path.py``.
"""

from __future__ import annotations

import pytest
import torch

from megalite.core.pipeline_parallel.actions import Action, p2p_program, posting_plan
from megalite.core.pipeline_parallel.generators import SCHEDULES, generate, layout_of
from megalite.core.pipeline_parallel.p2p import RECEIVE_LEAD, P2PCommunicator
from megalite.core.pipeline_parallel.posting import POST, plan_for, receives_ahead
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


def _messages(items: list[tuple]) -> list[list[tuple]]:
    """Per batch, its messages (kind, micro-batch, receiving stage), sends and receives, in order
    (a ``Post`` of the executor's plan names it ``message``, a ``PostedOp`` by its fields)."""
    return [
        [getattr(op, "message", None) or (op.kind, op.microbatch, op.stage) for op in item]
        for code, item, _ in items
        if code == POST
    ]


def _plans_case(kwargs: dict) -> tuple[int, bool, bool]:
    """The communicator's lead; whether the executor's plan is ``posting_plan``'s batches with
    each receive that many batches earlier; whether it is ``posting_plan``'s own order."""
    ps = mesh(1, 2)
    layout = layout_of("1f1b", 2)
    p2p = _communicator(ps, **kwargs)
    compute = generate("1f1b", pp_size=2, num_microbatches=4)
    program = tuple(p2p_program(compute, layout)[ps.pp_rank])
    got = _messages(plan_for(program, layout, ps.pp_rank, p2p).items)
    plain = _items(posting_plan(program, layout, ps.pp_rank))
    ahead = receives_ahead(plain, p2p.receive_lead) if p2p.receive_lead else plain
    return p2p.receive_lead, got == _messages(ahead), got == _messages(plain)


@pytest.mark.parametrize(
    "kwargs, lead",
    [
        ({}, RECEIVE_LEAD),  # gloo's default: tags, op by op, consumers wait
        ({"receive_lead": 1}, 1),
        ({"receive_lead": 0}, 0),
        ({"tagged": False}, 0),  # as nccl matches: p2p_program's pairing is needed
        ({"overlap": False}, 0),  # a batch is waited for as posted
        ({"batched": True}, 0),  # one batch_isend_irecv per batch
    ],
)
def test_the_executor_posts_receives_ahead_only_where_tags_match_them_op_by_op(kwargs, lead):
    for rank, (got_lead, as_ahead, as_plain) in enumerate(run_distributed(_plans_case, 2, kwargs)):
        assert got_lead == lead and as_ahead, (rank, kwargs)
        assert as_plain is (lead == 0), (rank, kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"receive_lead": 2, "tagged": False},
        {"receive_lead": 1, "overlap": False},
        {"receive_lead": -1},
    ],
)
def test_a_lead_the_communicator_cannot_keep_is_refused_in_one_line(kwargs):
    with pytest.raises(ValueError, match=r"^receive_lead=-?\d+: .*pass receive_lead=0 or None$"):
        P2PCommunicator(
            prev_rank=None,
            next_rank=1,
            tensor_shape=(3, 8),
            dtype=torch.float32,
            device=torch.device("cpu"),
            group=None,
            **kwargs,
        )


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

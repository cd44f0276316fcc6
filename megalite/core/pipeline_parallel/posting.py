"""One rank's ``actions.posting_plan`` resolved for a communicator, once, not every step.

    plan = plan_for(program, layout, pp_rank, p2p)     # kept on p2p while program is the same tuple
    for is_compute, item, extra in plan.items: ...

What a step of the executor (``executor.py``) does depends only on the program (the schedule, the
number of micro-batches and chunks), the layout, the rank and the communicator (its peers' ranks,
its tags): the posting plan itself, the chunks each backward runs inside ``no_sync``, the global
and group rank of each message's peer. The schedules hand the executor the same program object
every step (``forward_backward._programs`` is cached), so the plan is resolved at the first step
and looked up by identity afterwards.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from megalite.core.pipeline_parallel.actions import Action, P2PBatch, StageLayout, posting_plan
from megalite.core.pipeline_parallel.p2p import P2PCommunicator


class Post(NamedTuple):
    """One ``PostedOp`` of the plan, resolved: the peer's global rank, the keys of what it moves."""

    send: bool
    kind: str  # "F": an activation, "B": the grad of one
    to: int  # the peer's global rank
    tag: int
    message: tuple[str, int, int]  # (kind, micro-batch, receiving stage)
    out_key: tuple[int, int]  # (micro-batch, chunk) of the tensor sent or received


class Plan:
    """One rank's ``posting_plan`` resolved once for a communicator: per item, a compute
    ``Action`` with the chunks that run it inside ``no_sync`` (every chunk but those whose grads
    it touches last), or the ops of one batch with their peers' global ranks. It depends only on
    the program, the layout, this rank and the communicator, so a run keeps it between steps."""

    def __init__(
        self,
        program: Sequence[Action | P2PBatch],
        layout: StageLayout,
        pp_rank: int,
        p2p: P2PCommunicator,
    ):
        plan = posting_plan(program, layout, pp_rank, tagged=p2p.tagged)
        last: dict[int, int] = {}  # chunk -> index of its last B, I or W
        for i, a in enumerate(plan):
            if isinstance(a, Action) and a.op in ("B", "I", "W"):
                last[a.chunk] = i
        # (True, action, chunks under no_sync) or (False, ops, the forward-only ops)
        self.items: list[tuple] = []
        for i, item in enumerate(plan):
            if isinstance(item, Action):
                synced = tuple(k for k in range(layout.num_chunks) if last.get(k) != i)
                self.items.append((True, item, synced))
                continue
            ops = tuple(
                Post(
                    op.send,
                    op.kind,
                    p2p.global_rank(op.peer, pp_rank),
                    op.tag,
                    (op.kind, op.microbatch, op.stage),
                    (op.microbatch, op.chunk),
                )
                for op in item
            )
            self.items.append((False, ops, tuple(o for o in ops if o.kind == "F")))


def plan_for(
    program: Sequence[Action | P2PBatch], layout: StageLayout, pp_rank: int, p2p: P2PCommunicator
) -> Plan:
    """``program``'s ``Plan``, kept on ``p2p`` for the next steps when the program is a tuple
    (the schedules' programs are, and are the same object every step); a list is resolved anew."""
    if not isinstance(program, tuple):
        return Plan(program, layout, pp_rank, p2p)
    key = (id(program), layout, pp_rank)
    kept = p2p.plans.get(key)
    if kept is None or kept[0] is not program:
        if len(p2p.plans) >= 64:  # programs of a long-gone shape: start over
            p2p.plans.clear()
        kept = p2p.plans[key] = (program, Plan(program, layout, pp_rank, p2p))
    return kept[1]

"""One rank's ``actions.posting_plan`` resolved for a communicator, once, not every step.

    plan = plan_for(program, layout, pp_rank, p2p)     # kept on p2p while program is the same tuple
    for code, item, extra in plan.items: ...           # code: F, BACKWARD, W or POST

What a step of the executor (``executor.py``) does depends only on the program (the schedule, the
number of micro-batches and chunks), the layout, the rank and the communicator (its peers' ranks,
its tags, how it posts): the posting plan itself, the chunks each backward runs inside
``no_sync``, each compute action's keys (the message it consumes, where its result goes), and
each message's peer with the call that posts it. The schedules hand the executor the same program
object every step (``forward_backward._programs`` is cached), so the plan is resolved at the first
step and looked up by identity afterwards; per action the executor then builds no key and makes
no lookup that this module could make once. Where the communicator matches messages by tag and
posts op by op, with receives waited for by their consumers (gloo), the plan also posts each
receive ``p2p.receive_lead`` batches earlier than ``p2p_program`` does (``receives_ahead``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from megalite.core.pipeline_parallel.actions import Action, P2PBatch, StageLayout, posting_plan
from megalite.core.pipeline_parallel.p2p import P2PCommunicator
from megalite.core.pipeline_parallel.timeline import span_label

# what an item of ``Plan.items`` is: the index of the executor's handler for it
F, BACKWARD, W, POST = 0, 1, 2, 3


class Compute(NamedTuple):
    """One compute action of the plan with what the executor looks up for it, resolved."""

    action: Action
    op: str  # "F", "B", "I" or "W"
    microbatch: int
    chunk: int
    key: tuple[int, int]  # (micro-batch, chunk): the tensors this action keeps or takes
    # the message it consumes: F's input (None on stage 0), B / I's output grad (None on the
    # loss stage); received, or handed over by this rank's other chunk at the turn of a V
    needs: tuple[str, int, int] | None
    # the message its result becomes on this rank at the turn of a V (F: the next stage's
    # input, B / I: the previous stage's output grad), else None
    hands: tuple[str, int, int] | None
    sends: bool  # its result is sent to another rank (kept until the batch that posts it)
    loss: bool  # the chunk holds the loss stage
    label: str  # its span's label in a ``Timeline``


class Post(NamedTuple):
    """One ``PostedOp`` of the plan, resolved: the peer's global rank, the keys of what it moves,
    and (where the communicator posts op by op) the process group's call and the peer's rank in
    the group."""

    send: bool
    kind: str  # "F": an activation, "B": the grad of one
    to: int  # the peer's global rank
    tag: int
    message: tuple[str, int, int]  # (kind, micro-batch, receiving stage)
    out_key: tuple[int, int]  # (micro-batch, chunk) of the tensor sent or received
    call: Callable | None  # the group's send or recv (``P2PCommunicator.direct``), else None
    group_rank: int  # the peer's rank in the group (with ``call``)


def _compute(a: Action, layout: StageLayout, pp_rank: int) -> Compute:
    S, s = layout.num_stages, layout.stage(pp_rank, a.chunk)
    mb = a.microbatch
    needs = hands = None
    sends = False
    if a.op == "F":
        needs = ("F", mb, s) if s > 0 else None
        if s < S - 1:
            if layout.place(s + 1)[0] == pp_rank:
                hands = ("F", mb, s + 1)
            else:
                sends = True
    elif a.op in ("B", "I"):
        needs = ("B", mb, s) if s < S - 1 else None
        if s > 0:
            if layout.place(s - 1)[0] == pp_rank:
                hands = ("B", mb, s - 1)
            else:
                sends = True
    label = span_label(a.op, mb, a.chunk)
    return Compute(a, a.op, mb, a.chunk, (mb, a.chunk), needs, hands, sends, s == S - 1, label)


class Plan:
    """One rank's ``posting_plan`` resolved once for a communicator: per item ``(code, item,
    extra)``, a compute action (``Compute``, code F, BACKWARD for B and I, or W) with the chunks
    that run it inside ``no_sync`` (every chunk but those whose grads it touches last), or (code
    POST) the ``Post`` s of one batch with those of them a forward-only run posts. It depends only
    on the program, the layout, this rank and the communicator, so a run keeps it between steps.
    ``defers``: the program splits a backward (an I), so the chunks' linear layers need a
    ``WeightGradStore``. Receives go ``p2p.receive_lead`` batches early (``receives_ahead``)."""

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
        self.defers = any(isinstance(a, Action) and a.op == "I" for a in plan)
        self.items: list[tuple] = []
        code = {"F": F, "B": BACKWARD, "I": BACKWARD, "W": W}
        for i, item in enumerate(plan):
            if isinstance(item, Action):
                synced = tuple(k for k in range(layout.num_chunks) if last.get(k) != i)
                self.items.append((code[item.op], _compute(item, layout, pp_rank), synced))
                continue
            ops = []
            for op in item:
                to = p2p.global_rank(op.peer, pp_rank)
                call, group_rank = p2p.direct(op.send, to)
                message = (op.kind, op.microbatch, op.stage)
                out_key = (op.microbatch, op.chunk)
                ops.append(Post(op.send, op.kind, to, op.tag, message, out_key, call, group_rank))
            ops = tuple(ops)
            self.items.append((POST, ops, tuple(o for o in ops if o.kind == "F")))
        if p2p.receive_lead:
            self.items = receives_ahead(self.items, p2p.receive_lead)


def receives_ahead(items: list[tuple], lead: int) -> list[tuple]:
    """``items`` with each receive posted ``lead`` batches earlier than ``p2p_program`` put it
    (in the rank's first batch at the earliest); a batch left empty is dropped. For a
    communicator that matches messages by tag and posts op by op (gloo): no batch has to pair up
    with a partner's and no order has to match, so an early receive cannot deadlock or take
    another message's bytes. A receive posted before its sender's send lets the backend move the
    bytes as the send is posted; posted late, it first has to tell the sender it is ready, and
    the sender's side moves the bytes only once it gets a core back from the computing ranks
    (milliseconds where the ranks share cores). Each batch of lead holds at most one more buffer
    per kind of message."""
    posts = [i for i, (code, _, _) in enumerate(items) if code == POST]
    ops: dict[int, list[Post]] = {i: [op for op in items[i][1] if op.send] for i in posts}
    for k, i in enumerate(posts):  # receives in their batch's order, batch by batch
        ops[posts[max(0, k - lead)]].extend(op for op in items[i][1] if not op.send)
    out = []
    for i, (code, item, extra) in enumerate(items):
        if code != POST:
            out.append((code, item, extra))
        elif ops[i]:
            moved = tuple(ops[i])
            out.append((POST, moved, tuple(op for op in moved if op.kind == "F")))
    return out


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

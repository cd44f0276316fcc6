"""One representation for every pipeline schedule: per-rank lists of actions.

An action is ``(op, microbatch, chunk)`` with ``chunk`` the index into this rank's model chunks:

    F       forward of one micro-batch through one chunk
    B       its whole backward (input grads and weight grads)
    I       the input-grad half of B; the weight grads of the chunk's linear layers are queued
    W       the queued weight grads of that (micro-batch, chunk), now
    SEND_F  send F's output to the next stage        RECV_F  receive the input of an F
    SEND_B  send B's / I's input grad to the previous stage    RECV_B  receive the grad of an F's
                                                                       output

A ``StageLayout`` says where each of the ``S = pp_size x num_chunks`` global stages lives:

    loop  stage s is chunk s // p of rank s % p (Megatron's interleaving: rank r holds chunks
          r, r + p, ...; with one chunk it is plain pipelining)
    v     two chunks: chunk 0 of rank r is stage r, chunk 1 is stage 2p - 1 - r (ZBV, DualPipeV),
          so the last rank runs stages p - 1 and p back to back and the loss is on rank 0

Generators (``generators.py``) give the compute order (F, B, I, W) of every rank; ``with_p2p``
adds the communication a layout needs, one pair per stage boundary that crosses ranks. The
executor runs the lists, the simulator replays them with given durations, and the timeline draws
either. Layer blocks follow the stage number: stage s holds the s-th block of layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

COMPUTE = ("F", "B", "I", "W")
COMM = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")


@dataclass(frozen=True)
class Action:
    op: str
    microbatch: int
    chunk: int = 0

    def __post_init__(self) -> None:
        if self.op not in COMPUTE + COMM:
            raise ValueError(f"unknown pipeline action {self.op!r}; one of {COMPUTE + COMM}")

    def __str__(self) -> str:
        return f"{self.op}{self.microbatch}.{self.chunk}"


@dataclass(frozen=True)
class StageLayout:
    pp_size: int
    num_chunks: int = 1
    shape: str = "loop"  # or "v"

    def __post_init__(self) -> None:
        if self.shape not in ("loop", "v"):
            raise ValueError(f"stage layout shape must be 'loop' or 'v', got {self.shape!r}")
        if self.shape == "v" and self.num_chunks != 2:
            raise ValueError(f"a V layout holds 2 chunks per rank, got {self.num_chunks}")
        if self.pp_size < 1 or self.num_chunks < 1:
            raise ValueError(
                f"need pp_size >= 1 and num_chunks >= 1, got {self.pp_size}, {self.num_chunks}"
            )

    @property
    def num_stages(self) -> int:
        return self.pp_size * self.num_chunks

    def stage(self, rank: int, chunk: int) -> int:
        """Global stage number of ``chunk`` of pipeline rank ``rank``."""
        p = self.pp_size
        if self.shape == "v":
            return rank if chunk == 0 else 2 * p - 1 - rank
        return chunk * p + rank

    def place(self, stage: int) -> tuple[int, int]:
        """``(rank, chunk)`` holding global stage ``stage``."""
        p = self.pp_size
        if self.shape == "v":
            return (stage, 0) if stage < p else (2 * p - 1 - stage, 1)
        return stage % p, stage // p

    def loss_rank(self) -> int:
        return self.place(self.num_stages - 1)[0]


class P2PBatch(NamedTuple):
    """The sends and receives one rank posts together (one ``batch_isend_irecv``) at ``tick``:
    SEND_F / SEND_B / RECV_F / RECV_B actions, in the order both ends of each message agree on."""

    tick: int
    actions: tuple[Action, ...]


def message(action: Action, rank: int, layout: StageLayout) -> tuple[str, int, int]:
    """``(kind, microbatch, receiving stage)`` of a SEND / RECV action of ``rank``: the same
    triple at both ends of the message (kind "F": an activation, "B": its grad)."""
    s = layout.stage(rank, action.chunk)
    kind = action.op[-1]
    if action.op.startswith("SEND"):
        return kind, action.microbatch, s + 1 if kind == "F" else s - 1
    return kind, action.microbatch, s


def peer(action: Action, rank: int, layout: StageLayout) -> int:
    """The pipeline rank at the other end of a SEND / RECV action of ``rank``."""
    kind, _, to_stage = message(action, rank, layout)
    if action.op.startswith("SEND"):
        return layout.place(to_stage)[0]
    return layout.place(to_stage - 1 if kind == "F" else to_stage + 1)[0]


def _needs(a: Action, rank: int, layout: StageLayout) -> tuple[str, int, int] | None:
    """The message a compute action waits for (None: nothing from another rank)."""
    s = layout.stage(rank, a.chunk)
    if a.op == "F" and s > 0 and layout.place(s - 1)[0] != rank:
        return "F", a.microbatch, s
    if a.op in ("B", "I") and s < layout.num_stages - 1 and layout.place(s + 1)[0] != rank:
        return "B", a.microbatch, s
    return None


def _sends(a: Action, rank: int, layout: StageLayout) -> tuple[Action, int, Action] | None:
    """(SEND action, receiving rank, its RECV action) for what a compute action produces."""
    s = layout.stage(rank, a.chunk)
    to = s + 1 if a.op == "F" else s - 1
    if a.op not in ("F", "B", "I") or not 0 <= to < layout.num_stages:
        return None
    dst, dst_chunk = layout.place(to)
    if dst == rank:  # the turn of a V: handed over in memory
        return None
    kind = "F" if a.op == "F" else "B"
    return (
        Action(f"SEND_{kind}", a.microbatch, a.chunk),
        dst,
        Action(f"RECV_{kind}", a.microbatch, dst_chunk),
    )


def p2p_program(compute: list[list[Action]], layout: StageLayout) -> list[list[Action | P2PBatch]]:
    """Every rank's compute actions with, between them, the ``P2PBatch`` es it posts: what the
    executor runs. Deadlock-free and FIFO-correct on a backend that ignores tags (nccl).

    Replay the lists in lockstep, one compute action per rank per tick (a rank waits while an
    input has not arrived: a message sent at tick t arrives at t + 1). Each message of tick t is
    sent in a batch right after the compute that made it, and received either early (in a batch
    before the receiver's own tick-t compute, so the transfer overlaps that compute) or late (in
    the batch after it, with the receiver's own sends). Early is chosen, soonest consumer first,
    wherever the batches of the tick still pair up without a cycle: merge each message's two
    batches into one class; no class may hold two batches of one rank, and the classes ordered by
    "a rank's batch before its compute precedes the one after" must be acyclic (two neighbours
    that both receive early from each other would wait on each other). Number the classes tick by
    tick in that order: each rank posts its batches in increasing number, and both ends of every
    message post it in the same class. On nccl a rank's batches run in posting order on one stream;
    by induction on the number, every batch of class k has all its predecessors done (a compute
    waits only for receives posted before it) and all its partners at the head of their streams,
    so class k completes even if a grouped launch needs every partner running at once. A rank
    computes, hence sends, at most one message per tick, so each direction of a pair carries at
    most one message per tick, posted in tick order at both ends: received in the order sent
    (FIFO), whatever the tags. Inside a batch the ops are sorted by ``message`` (the same key at
    both ends). ValueError when the lists wait on each other (no tick moves)."""
    p = layout.pp_size
    pos = [0] * p
    sent_at: dict[tuple[str, int, int], int] = {}  # message -> tick it was sent
    used_at: dict[tuple[str, int, int], int] = {}  # message -> tick of its consumer
    ticks: list[tuple[dict[int, Action], list[tuple[int, Action, int, Action]]]] = []
    t = 0
    while any(pos[r] < len(compute[r]) for r in range(p)):
        ran: dict[int, Action] = {}
        messages = []  # (sender, SEND action, receiver, RECV action)
        for r in range(p):
            if pos[r] == len(compute[r]):
                continue
            a = compute[r][pos[r]]
            need = _needs(a, r, layout)
            if need is not None and sent_at.get(need, t) >= t:
                continue  # its input has not arrived
            if need is not None:
                used_at[need] = t
            ran[r] = a
            pos[r] += 1
            send = _sends(a, r, layout)
            if send is not None:
                sent_at[message(send[0], r, layout)] = t
                messages.append((r, send[0], send[1], send[2]))
        if not ran:
            stuck = [f"{compute[r][pos[r]]}@rank{r}" for r in range(p) if pos[r] < len(compute[r])]
            raise ValueError(f"the action lists wait on each other: stuck at {', '.join(stuck)}")
        ticks.append((ran, messages))
        t += 1
    out: list[list[Action | P2PBatch]] = [[] for _ in range(p)]
    for t, (ran, messages) in enumerate(ticks):
        messages.sort(key=lambda x: (used_at.get(message(x[1], x[0], layout), t), x[0]))
        early = [False] * len(messages)  # all late pairs up: each class is after-batches only
        for i in range(len(messages)):  # greedy: early where the tick's batches still pair up
            early[i] = True
            early[i] = _pairs_up(ran, messages, early, p)
        pre: list[list[Action]] = [[] for _ in range(p)]
        post: list[list[Action]] = [[] for _ in range(p)]
        for (src, send, dst, recv), e in zip(messages, early):
            post[src].append(send)
            (pre if e and dst in ran else post)[dst].append(recv)
        for r in range(p):
            for acts, compute_action in ((pre[r], ran.get(r)), (post[r], None)):
                if acts:
                    acts.sort(key=lambda a, r=r: message(a, r, layout))
                    out[r].append(P2PBatch(t, tuple(acts)))
                if compute_action is not None:
                    out[r].append(compute_action)
    return out


def _pairs_up(ran: dict[int, Action], messages: list, early: list[bool], p: int) -> bool:
    """One tick's batches, ``early[i]`` choosing where message i is received: no class of
    matched batches holds both batches of a rank, and the classes are acyclic under "a rank's
    batch before its compute precedes the one after". Nodes: 2r (before), 2r + 1 (after); a rank
    that does not compute this tick has one batch (2r + 1)."""
    parent = list(range(2 * p))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for (src, _, dst, _), e in zip(messages, early):
        parent[find(2 * src + 1)] = find(2 * dst + (0 if e and dst in ran else 1))
    edges = {}
    for r in ran:
        a, b = find(2 * r), find(2 * r + 1)
        if a == b:
            return False
        edges.setdefault(a, set()).add(b)
    state: dict[int, int] = {}  # 1: on the stack, 2: done

    def cyclic(x: int) -> bool:
        state[x] = 1
        for y in edges.get(x, ()):
            if state.get(y) == 1 or (y not in state and cyclic(y)):
                return True
        state[x] = 2
        return False

    return not any(x not in state and cyclic(x) for x in list(edges))


def flatten(program: list[Action | P2PBatch]) -> list[Action]:
    """One rank's program as a plain action list (each batch's actions in posting order)."""
    return [
        x for item in program for x in (item.actions if isinstance(item, P2PBatch) else (item,))
    ]


def with_p2p(
    compute: list[list[Action]], layout: StageLayout, *, overlap: bool = True
) -> list[list[Action]]:
    """``compute`` with the sends and receives ``layout`` needs, where the executor posts them
    (``p2p_program``, flattened): a SEND after the action that produces the tensor, a RECV in the
    same batch, before the action that consumes it. Transfers between two chunks of the same rank
    (the turn of a V) need no action. ``overlap`` changes when the executor waits, not the order.
    Lists that cannot run (a wait cycle) get each RECV right before its consumer, for the
    simulator to name the stuck action."""
    try:
        return [flatten(program) for program in p2p_program(compute, layout)]
    except ValueError:
        return _with_p2p_per_action(compute, layout, overlap=overlap)


def _with_p2p_per_action(
    compute: list[list[Action]], layout: StageLayout, *, overlap: bool
) -> list[list[Action]]:
    out = []
    for rank, actions in enumerate(compute):
        lists: list[Action] = []
        for action in actions:
            if _needs(action, rank, layout) is not None:
                recv = Action(
                    f"RECV_{'F' if action.op == 'F' else 'B'}", action.microbatch, action.chunk
                )
                computes = [i for i, a in enumerate(lists) if a.op in COMPUTE]
                lists.insert(computes[-1] if overlap and computes else len(lists), recv)
            lists.append(action)
            send = _sends(action, rank, layout)
            if send is not None:
                lists.append(send[0])
        out.append(lists)
    return out


class PostedOp(NamedTuple):
    """One ``isend`` / ``irecv`` of a posted batch. ``stage``: the receiving stage; ``chunk``:
    this rank's chunk that produced (send) or will consume (recv) the tensor."""

    send: bool
    peer: int  # pipeline rank at the other end
    kind: str  # "F": an activation, "B": the grad of one
    microbatch: int
    stage: int
    chunk: int
    tag: int


def message_tag(kind: str, microbatch: int, stage: int, num_stages: int) -> int:
    return (0 if kind == "F" else 1) + 2 * (stage + num_stages * microbatch)


def posting_plan(
    program: Sequence[Action | P2PBatch], layout: StageLayout, pp_rank: int, *, tagged: bool = True
) -> list[Action | tuple[PostedOp, ...]]:
    """What the executor does, in order: a compute ``Action``, or a tuple of ``PostedOp`` posted
    as one ``batch_isend_irecv`` (in tuple order). A pure function of the program: the tests check
    on it, for every schedule, that the two ends of each message post it in batches that pair up
    (deadlock-free) and that each direction is received in the order it is sent (FIFO)."""
    out: list[Action | tuple[PostedOp, ...]] = []
    for item in program:
        if isinstance(item, Action) and item.op not in COMM:
            out.append(item)
            continue
        ops = []
        for a in item.actions if isinstance(item, P2PBatch) else (item,):
            kind, mb, stage = message(a, pp_rank, layout)
            tag = message_tag(kind, mb, stage, layout.num_stages) if tagged else 0
            send = a.op.startswith("SEND")
            ops.append(PostedOp(send, peer(a, pp_rank, layout), kind, mb, stage, a.chunk, tag))
        out.append(tuple(ops))
    return out


def format_actions(actions: list[Action]) -> str:
    return " ".join(str(a) for a in actions)

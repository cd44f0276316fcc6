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
    executor runs. Deadlock-free and FIFO-correct on a backend that ignores tags (nccl):

    Replay the lists in lockstep, one compute action per rank per tick (a rank waits while an
    input has not arrived: a message sent at tick t arrives at t + 1). A message produced at tick
    t goes into batch t of its sender (after that compute) and of its receiver (after its tick-t
    compute, or in its wait), so both ends post it in a batch with the same label, and each rank
    posts its batches in increasing tick order. On nccl a rank's batches run in posting order on
    one stream and a batch completes once the peers' batches it matches are running; by induction
    on t every tick-t batch then has its predecessors done and all its partners running, so it
    completes (a compute only waits for receives of earlier ticks). A rank computes, hence sends,
    at most one message per tick, so each direction of a pair carries at most one message per
    tick: messages are received in the order they are sent (FIFO), whatever the tags. Inside a
    batch the ops are sorted by ``message`` (the same key at both ends). A receive is posted in
    the batch where its message is sent, the earliest point both ends can agree on (posting it a
    compute earlier, in a batch of its own, makes two neighbours exchanging both ways wait on each
    other); with overlap its consumer waits for it at use.

    ValueError when the lists wait on each other (no tick moves)."""
    p = layout.pp_size
    pos = [0] * p
    sent_at: dict[tuple[str, int, int], int] = {}  # message -> tick it was sent
    out: list[list[Action | P2PBatch]] = [[] for _ in range(p)]
    t = 0
    while any(pos[r] < len(compute[r]) for r in range(p)):
        batches: list[list[Action]] = [[] for _ in range(p)]
        moved = False
        for r in range(p):
            if pos[r] == len(compute[r]):
                continue
            a = compute[r][pos[r]]
            need = _needs(a, r, layout)
            if need is not None and sent_at.get(need, t) >= t:
                continue  # its input has not arrived
            out[r].append(a)
            pos[r] += 1
            moved = True
            send = _sends(a, r, layout)
            if send is not None:
                send_action, dst, recv_action = send
                sent_at[message(send_action, r, layout)] = t
                batches[r].append(send_action)
                batches[dst].append(recv_action)
        if not moved:
            stuck = [f"{compute[r][pos[r]]}@rank{r}" for r in range(p) if pos[r] < len(compute[r])]
            raise ValueError(f"the action lists wait on each other: stuck at {', '.join(stuck)}")
        for r, acts in enumerate(batches):
            if acts:
                acts.sort(key=lambda a, r=r: message(a, r, layout))
                out[r].append(P2PBatch(t, tuple(acts)))
        t += 1
    return out


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


def format_actions(actions: list[Action]) -> str:
    return " ".join(str(a) for a in actions)

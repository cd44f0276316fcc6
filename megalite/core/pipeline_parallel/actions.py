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


def with_p2p(
    compute: list[list[Action]], layout: StageLayout, *, overlap: bool = True
) -> list[list[Action]]:
    """Insert the sends and receives ``compute`` needs under ``layout``: a SEND right after the
    action that produces the tensor, a RECV before the action that consumes it -- right before
    without ``overlap``, one compute action earlier with it (posted early, waited at use).
    Transfers between two chunks of the same rank (the turn of a V) need no action."""
    out = []
    for rank, actions in enumerate(compute):
        lists: list[Action] = []
        for action in actions:
            s = layout.stage(rank, action.chunk)
            recv = None
            if action.op == "F" and s > 0 and layout.place(s - 1)[0] != rank:
                recv = Action("RECV_F", action.microbatch, action.chunk)
            last = layout.num_stages - 1
            if action.op in ("B", "I") and s < last and layout.place(s + 1)[0] != rank:
                recv = Action("RECV_B", action.microbatch, action.chunk)
            if recv is not None:
                computes = [i for i, a in enumerate(lists) if a.op in COMPUTE]
                # with overlap: posted before the previous compute action, waited at use
                lists.insert(computes[-1] if overlap and computes else len(lists), recv)
            lists.append(action)
            if action.op == "F" and s < layout.num_stages - 1 and layout.place(s + 1)[0] != rank:
                lists.append(Action("SEND_F", action.microbatch, action.chunk))
            if action.op in ("B", "I") and s > 0 and layout.place(s - 1)[0] != rank:
                lists.append(Action("SEND_B", action.microbatch, action.chunk))
        out.append(lists)
    return out


def format_actions(actions: list[Action]) -> str:
    return " ".join(str(a) for a in actions)

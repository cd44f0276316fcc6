"""Communication of context-parallel attention: the ring's neighbour exchange, and counters.

Every collective here adds the bytes this rank puts on the wire to a ``CommStats`` (when one is
passed) by the algorithm's count, not by a measurement: a ring send of ``B`` bytes counts ``B``;
an all-gather / reduce-scatter over CP ranks of a local piece of ``B`` bytes counts ``(CP-1) B``;
an all-to-all of a local tensor of ``B`` bytes counts ``(CP-1)/CP B``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megalite.core.groups import group_rank, group_size


@dataclass
class CommStats:
    """What one rank's CP attention did since the last ``reset``: bytes sent, seconds blocked in a
    wait (communication not hidden), seconds computing attention blocks, and the forward
    attention FLOPs of the unmasked score entries it computed."""

    bytes_sent: int = 0
    wait_s: float = 0.0
    compute_s: float = 0.0
    flops: int = 0

    def reset(self) -> None:
        self.bytes_sent, self.wait_s, self.compute_s, self.flops = 0, 0.0, 0.0, 0


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Ring:
    """The cp group seen as a ring: send to ``rank + 1``, receive from ``rank - 1`` (mod size)."""

    def __init__(self, group, stats: CommStats | None = None):
        self.group, self.stats = group, stats
        self.size, self.rank = group_size(group), group_rank(group)
        if self.size > 1:
            self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
            self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def exchange(self, send: torch.Tensor, recv: torch.Tensor, *, tag: int) -> list:
        """Start sending ``send`` to the next rank and receiving the previous rank's into
        ``recv``; returns the requests for ``wait``. ``send`` must not change until then."""
        if self.stats is not None:
            self.stats.bytes_sent += nbytes(send)
        # one batch: on nccl a lone send and a lone recv on the same peer pair can deadlock (the
        # send waits for a recv queued behind it); tags are ignored there, order matches instead
        ops = [
            dist.P2POp(dist.isend, send, self.next, self.group, tag),
            dist.P2POp(dist.irecv, recv, self.prev, self.group, tag),
        ]
        return dist.batch_isend_irecv(ops)

    def wait(self, requests: list) -> None:
        start = time.perf_counter()
        for req in requests:
            req.wait()
        if self.stats is not None:
            self.stats.wait_s += time.perf_counter() - start


class Timer:
    """``with Timer(stats):`` adds the block's seconds to ``stats.compute_s`` (no-op without)."""

    field = "compute_s"

    def __init__(self, stats: CommStats | None):
        self.stats = stats

    def __enter__(self) -> Timer:
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.stats is not None:
            elapsed = time.perf_counter() - self.start
            setattr(self.stats, self.field, getattr(self.stats, self.field) + elapsed)


class WaitTimer(Timer):
    """``with WaitTimer(stats):`` adds a blocking collective's seconds to ``stats.wait_s``."""

    field = "wait_s"

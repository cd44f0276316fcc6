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
from megalite.core.op_record import RECORDER, RecordedWork


@dataclass
class CommStats:
    """What one rank's CP attention did since the last ``reset``: bytes sent, ring messages sent
    (``Ring.exchange`` calls), seconds blocked in a wait (communication not hidden), seconds
    computing attention blocks, and the forward attention FLOPs of the dense blocks it computed
    (their unmasked score entries)."""

    bytes_sent: int = 0
    sends: int = 0
    wait_s: float = 0.0
    compute_s: float = 0.0
    flops: int = 0

    def reset(self) -> None:
        self.bytes_sent, self.sends, self.wait_s, self.compute_s, self.flops = 0, 0, 0.0, 0.0, 0


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Ring:
    """The cp group seen as a ring: ``exchange`` sends ``distance`` ranks ahead and receives from
    as many behind (mod size); distance 1 is the neighbour ring."""

    def __init__(self, group, stats: CommStats | None = None):
        self.group, self.stats = group, stats
        self.size, self.rank = group_size(group), group_rank(group)

    def _global(self, offset: int) -> int:
        return dist.get_global_rank(self.group, (self.rank + offset) % self.size)

    def exchange(
        self,
        send: torch.Tensor,
        recv: torch.Tensor,
        *,
        tag: int,
        distance: int = 1,
        what: str | None = None,
    ) -> RecordedWork:
        """Start sending ``send`` to rank ``rank + distance`` and receiving rank
        ``rank - distance``'s into ``recv``; returns the requests for ``wait``. ``send`` must not
        change until then. ``what`` names the message for the op recorder (a send and a receive,
        posted here, waited on in ``wait``)."""
        if self.stats is not None:
            self.stats.bytes_sent += nbytes(send)
            self.stats.sends += 1
        ahead, behind = self._global(distance), self._global(-distance)
        sent = RECORDER.post("send", axis="cp", what=what, peer=ahead, shape=send.shape)
        received = RECORDER.post("recv", axis="cp", what=what, peer=behind, shape=recv.shape)
        # one batch: on nccl a lone send and a lone recv on the same peer pair can deadlock (the
        # send waits for a recv queued behind it); tags are ignored there, order matches instead
        ops = [
            dist.P2POp(dist.isend, send, ahead, self.group, tag),
            dist.P2POp(dist.irecv, recv, behind, self.group, tag),
        ]
        works = dist.batch_isend_irecv(ops)
        RECORDER.end(sent)  # a send is recorded as done once posted: the receive is waited on
        return RecordedWork(works, received, RECORDER)

    def wait(self, requests: RecordedWork) -> None:
        start = time.perf_counter()
        requests.wait()
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

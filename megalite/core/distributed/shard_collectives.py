"""The two data-parallel collectives of the sharded rungs (ZeRO-1/2/3), on a flat buffer split
into ``dp_size`` shards.

    reduce_scatter_shard(data, dp_group)   # shard r of data <- sum over ranks of shard r
    all_gather_shard(data, dp_group)       # every shard of data <- its owner's shard

``data`` is a contiguous 1-D tensor whose length is a multiple of the group size; rank ``r`` of the
group owns ``data.chunk(dp_size)[r]`` (``shard_bounds``). Both work in place: after
``reduce_scatter_shard`` only this rank's shard is defined (the other shards hold partial sums);
after ``all_gather_shard`` every rank holds every owner's shard. On a group of one both return at
once.

Backends. On NCCL they are ``reduce_scatter_tensor`` / ``all_gather_tensor`` (in place is allowed:
the output is this rank's shard of the input). On gloo those two take 2.0x and 1.5x the time of an
all-reduce of the same buffer (the collectives benchmark of ``tools/bench/bench_zero.py``, DP 2,
20M fp32), which would make the sharded rungs slower than plain data parallelism on CPU, so on gloo
both are direct exchanges over point-to-point sends (0.66x and 0.46x of the all-reduce):

- reduce-scatter: each rank sends shard ``j`` of its data to rank ``j`` and adds what the others
  send for its own shard (each rank sends ``(dp-1)/dp`` of the buffer, the bytes of a ring
  reduce-scatter), in pieces of ``PIECE`` elements, double-buffered so one piece is in flight
  while the previous is summed (scratch memory ``2 (dp-1) PIECE``);
- all-gather: each rank sends its shard to every other rank and receives theirs in place (both
  directions of every link busy at once).

The owner sums its shard in rank order (its own contribution first, then the others ascending), and
only the owner sums it, so every rank ends with the same bits.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megalite.core.groups import all_gather_tensor, group_rank, group_size, reduce_scatter_tensor
from megalite.core.op_record import RECORDER, RecordedWork

PIECE = 1 << 21  # elements per exchanged piece on gloo (8 MiB of fp32)


def shard_bounds(numel: int, dp_size: int, dp_rank: int) -> tuple[int, int]:
    """``[lo, hi)`` of rank ``dp_rank``'s shard of a buffer of ``numel`` elements."""
    if numel % dp_size:
        raise ValueError(f"buffer of {numel} elements does not split into {dp_size} equal shards")
    size = numel // dp_size
    return dp_rank * size, (dp_rank + 1) * size


def _is_gloo(group) -> bool:
    return dist.get_backend(group) == "gloo"


class ScratchBuffers:
    """Receive buffers for the gloo exchange, kept between calls by their owner (one per dtype and
    device); the grad-sync wrapper holds one."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def get(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (dtype, device)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = self._buffers[key] = torch.empty(numel, dtype=dtype, device=device)
        return buf[:numel]


def _exchange_reduce_scatter(data: torch.Tensor, group, scratch: ScratchBuffers) -> None:
    """Gloo: sum every rank's shard ``r`` into rank ``r``'s ``data`` (see the module docstring)."""
    size, rank = group_size(group), group_rank(group)
    shards = data.chunk(size)
    mine, n = shards[rank], shards[rank].numel()
    peers = [j for j in range(size) if j != rank]
    peer_global = {j: dist.get_global_rank(group, j) for j in peers}
    piece = min(PIECE, n)
    recv = scratch.get(2 * len(peers) * piece, data.dtype, data.device).view(2, len(peers), piece)
    starts = list(range(0, n, piece))

    def post(k: int) -> list:
        lo, hi = starts[k], min(starts[k] + piece, n)
        ops = []
        for i, j in enumerate(peers):
            ops.append(dist.P2POp(dist.isend, shards[j][lo:hi], peer_global[j], group))
            ops.append(dist.P2POp(dist.irecv, recv[k % 2, i, : hi - lo], peer_global[j], group))
        return dist.batch_isend_irecv(ops)

    pending = post(0)
    for k, lo in enumerate(starts):
        hi = min(lo + piece, n)
        following = post(k + 1) if k + 1 < len(starts) else []  # slot (k+1)%2 is free by now
        for work in pending:
            work.wait()
        for i in range(len(peers)):
            mine[lo:hi].add_(recv[k % 2, i, : hi - lo])
        pending = following


def reduce_scatter_shard(
    data: torch.Tensor, group, *, scratch: ScratchBuffers | None = None
) -> None:
    """In place: this rank's shard of ``data`` [n] <- the sum over ``group`` of that shard."""
    size = group_size(group)
    if size == 1:
        return
    lo, hi = shard_bounds(data.numel(), size, group_rank(group))
    if _is_gloo(group):
        _exchange_reduce_scatter(data, group, scratch or ScratchBuffers())
    else:
        reduce_scatter_tensor(data[lo:hi], data, group)


class PendingReduceScatter:
    """A reduce-scatter in flight (``start_reduce_scatter_shard``); ``wait()`` completes it."""

    def __init__(self, works: list, finish=None):
        self._works, self._finish = works, finish

    def wait(self) -> None:
        for work in self._works:
            work.wait()
        if self._finish is not None:
            self._finish()
        self._works, self._finish = [], None


def start_reduce_scatter_shard(data: torch.Tensor, group) -> PendingReduceScatter:
    """``reduce_scatter_shard`` without waiting: the result is in ``data``'s shard after
    ``wait()``. On gloo every piece is posted at once into a receive buffer of its own
    (``(dp-1)/dp`` of ``data``, freed by ``wait``), so several can be in flight; same sum order."""
    size = group_size(group)
    if size == 1:
        return PendingReduceScatter([])
    rank = group_rank(group)
    lo, hi = shard_bounds(data.numel(), size, rank)
    if not _is_gloo(group):
        work = reduce_scatter_tensor(data[lo:hi], data, group, async_op=True)
        return PendingReduceScatter([work])
    shards = data.chunk(size)
    peers = [j for j in range(size) if j != rank]
    recv = torch.empty((len(peers), hi - lo), dtype=data.dtype, device=data.device)
    ops = []
    for i, j in enumerate(peers):
        peer = dist.get_global_rank(group, j)
        ops.append(dist.P2POp(dist.isend, shards[j], peer, group))
        ops.append(dist.P2POp(dist.irecv, recv[i], peer, group))

    def finish() -> None:
        for i in range(len(peers)):
            shards[rank].add_(recv[i])

    return PendingReduceScatter(dist.batch_isend_irecv(ops), finish)


def all_gather_shard(
    data: torch.Tensor, group, *, async_op: bool = False, what: str | None = None
) -> list:
    """In place: shard ``r`` of ``data`` [n] <- rank ``r``'s shard, for every rank ``r`` of
    ``group``. With ``async_op`` returns the works to ``wait()`` on (else an empty list).
    ``what`` names the buffer for the op recorder (one ``all_gather`` record on the group's
    channel, also on gloo where it is made of sends and receives)."""
    size = group_size(group)
    if size == 1:
        return []
    rank = group_rank(group)
    if _is_gloo(group):
        record = RECORDER.post if async_op else RECORDER.begin
        rec = record("all_gather", group=group, axis="dp", what=what, shape=data.shape)
        shards = data.chunk(size)
        ops = []
        for j in range(size):
            if j != rank:
                peer = dist.get_global_rank(group, j)
                ops.append(dist.P2POp(dist.isend, shards[rank], peer, group))
                ops.append(dist.P2POp(dist.irecv, shards[j], peer, group))
        works = RecordedWork(dist.batch_isend_irecv(ops), rec, RECORDER)
        if async_op:
            return [works]
        works.wait()
        return []
    lo, hi = shard_bounds(data.numel(), size, rank)
    work = all_gather_tensor(data, data[lo:hi], group, async_op=async_op, what=what)
    return [work] if async_op else []

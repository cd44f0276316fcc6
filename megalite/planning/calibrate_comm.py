"""What a collective costs between busy ranks, measured in a CPU gloo world (every rank calls it).

A collective inside a training step comes between two pieces of compute: the ranks reach it at
slightly different moments (the faster one waits), and a rank that waits sleeps in the kernel and
must be woken (on a shared or virtual machine that is milliseconds, not microseconds). An idle
micro-benchmark (barrier, collective, repeat; its median) sees none of that: on this 2-core
machine a 64 KiB all-reduce takes 0.3-0.6 ms idle, its median, but 1.8-2.7 ms between two 5 ms
matmul loops, its mean. The step pays the mean. So each op's latency is timed as a loop of
``work(); op()`` against the loop of ``work()`` alone at a small size, its bandwidth idle at two
large sizes (where the transfer dominates); ``Cluster.collective_seconds`` charges
``latency + bus_factor(op, n) x bytes / bus_bandwidth``.

    figures = busy_collectives()  # {"all_reduce": {"latency_s": ..., "gbps": ...}, ...}

Ops: ``all_reduce``, ``all_gather`` (bytes: the output), ``reduce_scatter`` (bytes: the input),
``all_to_all``, ``p2p`` (one message each way between rank pairs, one ``batch_isend_irecv``: the
pipeline's and the context-parallel ring's pattern; bytes: one message).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

LATENCY_BYTES = 1 << 16  # a latency-bound size: timed between busy ranks
BANDWIDTH_BYTES = (1 << 18, 1 << 22)  # the sizes of activations and buckets: timed idle


def bus_factor(op: str, n: int) -> float:
    """Bytes on the busiest link per byte of the op's full tensor (nccl-tests' convention)."""
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op == "p2p":
        return 1.0
    return (n - 1) / n  # all_gather, reduce_scatter, all_to_all


def _ops(nbytes: int) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    numel = nbytes // 4 // world * world
    full, shard = torch.ones(numel), torch.ones(numel // world)
    out = torch.empty(numel)
    peer_to, peer_from = (rank + 1) % world, (rank - 1) % world
    recv = torch.empty(numel)

    def p2p() -> None:
        ops = [dist.P2POp(dist.isend, full, peer_to), dist.P2POp(dist.irecv, recv, peer_from)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    return {
        "all_reduce": lambda: dist.all_reduce(full),
        "all_gather": lambda: dist.all_gather_into_tensor(out, shard),
        "reduce_scatter": lambda: dist.reduce_scatter_tensor(shard, full),
        "all_to_all": lambda: dist.all_to_all_single(out, full),
        "p2p": p2p,
    }


def _loop(fn, work, n: int) -> float:
    """Seconds per iteration of ``work(); fn()``, the slowest rank's, over ``n`` iterations."""
    dist.barrier()
    start = time.perf_counter()
    for _ in range(n):
        work()
        fn()
    t = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item() / n


def _idle(fn, repeat: int) -> float:
    """Median seconds of ``fn`` started together on every rank (the slowest rank's)."""
    times = []
    for _ in range(repeat):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    t = torch.tensor([statistics.median(times)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def busy_collectives(*, iterations: int = 20, repeat: int = 3) -> dict:
    """Per op: ``latency_s`` between busy ranks and ``gbps`` (bus bandwidth; module docstring).
    The latency is the busy loop's cost at ``LATENCY_BYTES`` (medians of ``repeat`` loop pairs of
    ``iterations``); the bandwidth comes from two large sizes started together (``BANDWIDTH_BYTES``,
    medians), where the transfer dominates and the wake-up is noise. Collective over the default
    group; every rank gets the same figures."""
    world = dist.get_world_size()
    a, b = torch.randn(256, 256), torch.randn(256, 512)

    def work() -> None:  # ~3-5 ms of matmuls on one core: a transformer layer's pass here
        for _ in range(6):
            a @ b

    def nothing() -> None:
        pass

    ops = _ops(LATENCY_BYTES)
    for fn in ops.values():
        fn()  # warm up (connections, buffers)
    samples: dict[str, list[float]] = {name: [] for name in ops}
    for _ in range(repeat):
        base = _loop(nothing, work, iterations)
        for name, fn in ops.items():
            samples[name].append(_loop(fn, work, iterations) - base)
    medium, large = BANDWIDTH_BYTES
    timed = {n: {name: _idle(fn, 5) for name, fn in _ops(n).items()} for n in BANDWIDTH_BYTES}
    figures = {}
    for name, busy in samples.items():
        bus_bytes = bus_factor(name, world) * (large - medium)
        seconds_per_byte = max(timed[large][name] - timed[medium][name], 1e-12) / bus_bytes
        small = bus_factor(name, world) * LATENCY_BYTES * seconds_per_byte
        latency = max(statistics.median(busy) - small, 0.0)
        figures[name] = {"latency_s": latency, "gbps": 1 / seconds_per_byte / 1e9}
    return figures

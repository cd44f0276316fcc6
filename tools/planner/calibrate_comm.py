"""What a collective costs between busy ranks, measured in a CPU gloo world (every rank calls it).

A collective inside a training step comes between two pieces of compute: the ranks reach it at
slightly different moments (the faster one waits), and a rank that waits sleeps in the kernel and
must be woken (on a shared or virtual machine that is milliseconds, not microseconds). An idle
micro-benchmark (barrier, collective, repeat; its median) sees none of that: on this 2-core
machine a 64 KiB all-reduce takes 0.3-0.6 ms idle, its median, but 1.8-2.7 ms between two 5 ms
matmul loops, its mean. The step pays the mean. So each op is timed as a loop of ``work(); op()``
against the loop of ``work()`` alone, at a small and a large size (loop means are steady where
single idle timings are not: those catch the wake-ups at random); ``Cluster.collective_seconds``
charges ``latency + bus_factor(op, n) x bytes / bus_bandwidth``.

    figures = busy_collectives(world_group())  # {"all_reduce": {"latency_s": ..., "gbps": ...}}

Ops: ``all_reduce``, ``all_gather`` (bytes: the output), ``reduce_scatter`` (bytes: the input),
``all_to_all``, ``p2p`` (one message each way between rank pairs, one ``batch_isend_irecv``: the
pipeline's and the context-parallel ring's pattern; bytes: one message).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from megalite.core.groups import all_gather_tensor, reduce_scatter_tensor
from megalite.planning.cluster import bus_factor

LATENCY_BYTES = 1 << 16  # a latency-bound size
BANDWIDTH_BYTES = 1 << 22  # a bandwidth-bound size (activations, buckets)


def world_group() -> dist.ProcessGroup:
    """The default process group (every rank of the world) as the group object the harness
    passes to each collective: megalite's ``None`` means a group of one, torch's the world, so
    no collective here is given ``None``."""
    return dist.group.WORLD


def _ops(nbytes: int, group: dist.ProcessGroup) -> dict:
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    numel = nbytes // 4 // world * world
    full, shard = torch.ones(numel), torch.ones(numel // world)
    out = torch.empty(numel)
    # the ring's neighbours, as the global ranks P2POp takes
    peer_to = dist.get_global_rank(group, (rank + 1) % world)
    peer_from = dist.get_global_rank(group, (rank - 1) % world)
    recv = torch.empty(numel)

    def p2p() -> None:
        ops = [
            dist.P2POp(dist.isend, full, peer_to, group=group),
            dist.P2POp(dist.irecv, recv, peer_from, group=group),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    return {
        "all_reduce": lambda: dist.all_reduce(full, group=group),
        "all_gather": lambda: all_gather_tensor(out, shard, group),
        "reduce_scatter": lambda: reduce_scatter_tensor(shard, full, group),
        "all_to_all": lambda: dist.all_to_all_single(out, full, group=group),
        "p2p": p2p,
    }


def _loop(fn, work, n: int, group: dist.ProcessGroup) -> float:
    """Seconds per iteration of ``work(); fn()``, the slowest rank's, over ``n`` iterations."""
    dist.barrier(group=group)
    start = time.perf_counter()
    for _ in range(n):
        work()
        fn()
    t = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.item() / n


def _idle(fn, repeat: int, group: dist.ProcessGroup) -> float:
    """Median seconds of ``fn`` started together on every rank (the slowest rank's)."""
    times = []
    for _ in range(repeat):
        dist.barrier(group=group)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    t = torch.tensor([statistics.median(times)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.item()


def _busy(
    nbytes: int, work, group: dist.ProcessGroup, *, iterations: int, repeat: int
) -> dict[str, float]:
    """Per op: seconds it adds to a loop of ``work()`` (medians of ``repeat`` loop pairs)."""
    ops = _ops(nbytes, group)
    for fn in ops.values():
        fn()  # warm up (connections, buffers)
    samples: dict[str, list[float]] = {name: [] for name in ops}
    for _ in range(repeat):
        base = _loop(lambda: None, work, iterations, group)
        for name, fn in ops.items():
            samples[name].append(_loop(fn, work, iterations, group) - base)
    return {name: max(statistics.median(v), 0.0) for name, v in samples.items()}


def busy_collectives(group: dist.ProcessGroup, *, iterations: int = 40, repeat: int = 5) -> dict:
    """Per op, between busy ranks (module docstring): ``latency_s`` and ``gbps`` (bus bandwidth)
    fitted to the busy loop at ``LATENCY_BYTES`` and ``BANDWIDTH_BYTES`` (``repeat`` loop pairs of
    ``iterations`` at the first, fewer at the second: its transfer dominates), and
    ``idle_latency_s``: the op started by every rank at once (median), what a collective costs
    that follows another on the same ranks with only elementwise work between (the ranks arrive
    in step: sequence parallelism's all-gathers). Collective over ``group`` (every rank of it
    calls this and gets the same figures)."""
    world = dist.get_world_size(group)
    a, b = torch.randn(256, 256), torch.randn(256, 512)

    def work() -> None:  # ~3-5 ms of matmuls on one core: a transformer layer's pass here
        for _ in range(6):
            a @ b

    small = _busy(LATENCY_BYTES, work, group, iterations=iterations, repeat=repeat)
    large_iterations, large_repeat = max(iterations * 3 // 4, 1), max(repeat - 2, 1)
    large = _busy(BANDWIDTH_BYTES, work, group, iterations=large_iterations, repeat=large_repeat)
    idle = {name: _idle(fn, 9, group) for name, fn in _ops(LATENCY_BYTES, group).items()}
    figures = {}
    for name in small:
        bus_bytes = bus_factor(name, world) * (BANDWIDTH_BYTES - LATENCY_BYTES)
        # a loop pair that came out the wrong way round (the machine sped up between them):
        # bound the bandwidth by the large size's own time
        slope = large[name] - small[name]
        seconds_per_byte = (slope if slope > 0 else large[name]) / bus_bytes
        transfer = bus_factor(name, world) * LATENCY_BYTES * seconds_per_byte
        figures[name] = {
            "latency_s": max(small[name] - transfer, 0.0),
            "gbps": 1 / max(seconds_per_byte, 1e-15) / 1e9,
            "idle_latency_s": max(idle[name] - transfer, 0.0),
        }
    return figures

"""What one multi-rank test case costs in the harness, before and after pooling.

    python tools/bench/bench_harness.py [--world 2 4] [--cases 10]
    python tools/bench/bench_harness.py --tiny     # seconds: world 2, 1 case

"before": every case spawns ``world`` processes, imports torch, joins a gloo world, runs, tears down
(what ``torch.multiprocessing.spawn`` per test costs). "after": ``tests/harness.run_distributed``,
whose pooled workers are started once; a case is a queue round trip plus destroying the groups it
made.
Both run the same small case (build a TP mesh, one all-reduce).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from megalite.core.parallel_state import initialize_model_parallel  # noqa: E402
from tests.harness import WorkerPool, _worker, run_distributed, shutdown_pools  # noqa: E402


def small_case():
    ps = initialize_model_parallel(dist.get_world_size(), 1)
    t = torch.ones(4)
    dist.all_reduce(t, group=ps.tp_group)
    return t[0].item()


def spawn_per_case(world: int) -> float:
    ctx = mp.get_context("spawn")
    t0 = time.perf_counter()
    pool = WorkerPool.__new__(WorkerPool)  # one throwaway pool = spawn + init + one case + teardown
    pool.world_size, pool.threads = world, 0
    pool._tmp = tempfile.mkdtemp()
    pool._results = ctx.Queue()
    pool._tasks = [ctx.Queue() for _ in range(world)]
    init_file = os.path.join(pool._tmp, "rdzv")
    pool._procs = [
        ctx.Process(
            target=_worker,
            args=(r, world, init_file, pool._tasks[r], pool._results, 120, dict(os.environ)),
            daemon=True,  # as the pool's: a failure here must not leave the exit waiting on them
        )
        for r in range(world)
    ]
    for p in pool._procs:
        p.start()
    pool.run(small_case, (), {}, 120)
    pool.close()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--cases", type=int, default=10)
    parser.add_argument("--tiny", action="store_true", help="a smoke run: world 2, 1 case, 1 spawn")
    args = parser.parse_args()
    spawns = max(3, args.cases // 3)  # each starts a world: the costly side
    if args.tiny:
        args.world, args.cases, spawns = [2], 1, 1
    for world in args.world:
        before = statistics.median(spawn_per_case(world) for _ in range(spawns))
        run_distributed(small_case, world)  # start the pool once (its cost is paid once per suite)
        samples = []
        for _ in range(args.cases):
            t0 = time.perf_counter()
            run_distributed(small_case, world)
            samples.append(time.perf_counter() - t0)
        after = statistics.median(samples)
        print(
            f"world {world}: spawn per case {before * 1e3:.0f} ms, "
            f"pooled case {after * 1e3:.1f} ms "
            f"(median of {args.cases}); pooling is {before / after:.0f}x cheaper per case"
        )
        shutdown_pools()


if __name__ == "__main__":
    main()

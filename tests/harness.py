"""Run a function on N CPU ranks with gloo, cheaply, for tests.

    results = run_distributed(case_fn, 4, arg1, key=value)   # one result per rank, rank order

``case_fn`` must be importable (defined at module level of a test module); it runs on every rank of
a ``world_size``-process gloo world and reads its rank with ``torch.distributed.get_rank()``.

Cost: a fresh process that imports torch, torch._dynamo (the first optimizer step imports it)
and megalite spends 3-6 s of CPU before it runs a line of a case, so workers are pooled and forked
from a fork server that imported all that once (``tests/worker_preload.py``). A pool of
``world_size`` processes is started once, joins one gloo world through a ``file://`` rendezvous
(no port races between parallel test runs), and then serves case after case; process groups a case
made are destroyed after it. Workers see the environment of the moment their pool started, as
spawned processes would: a pool started while the environment differs from the fork server's (a
test's ``monkeypatch.setenv``) is spawned instead. ``tools/bench/bench_harness.py`` measures a
case with and without the pool.

Failures: an exception on any rank fails the test with that rank's number and traceback; a rank that
does not answer within ``timeout`` seconds (default 600: a hang guard, far above any case on a
loaded machine) fails it too. Either way the pool is killed, since the other ranks may be blocked
in a collective, and the next case starts a fresh one.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import multiprocessing.forkserver
import os
import queue
import shutil
import tempfile
import time
import traceback
from datetime import timedelta

# Imported here, before any pool starts, for its side effect on os.environ: torch._dynamo sets
# TORCHINDUCTOR_CACHE_DIR when first imported (the first optimizer step imports it). Imported later
# in this process, it would make the environment differ from the fork server's, and every pool
# after it would be spawned, each worker importing torch and megalite anew (3-6 s of CPU each).
import torch._dynamo  # noqa: F401

DEFAULT_TIMEOUT = 600.0  # a hang guard: only a blocked case waits for it
MAX_POOLS = 3  # world sizes kept warm at once (about 0.3 GB per worker)
# gloo keeps a socket loop thread per destroyed process group, and those of closed peers spin: a
# pool whose workers hold more threads than this is restarted before its next case
MAX_WORKER_THREADS = 48
PRELOAD = "tests.worker_preload"  # imported once by the fork server
_PER_TEST_ENV = ("PYTEST_CURRENT_TEST",)  # pytest rewrites it for every test
_FORKSERVER: dict[str, dict[str, str]] = {}  # "env": the environment the fork server started with


class DistributedCaseError(AssertionError):
    pass


def _worker(
    rank: int, world_size: int, init_file: str, tasks, results, timeout: float, env: dict
) -> None:
    if os.environ != env:  # forked from the fork server: the pool's environment, not the server's
        os.environ.clear()
        os.environ.update(env)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout),
    )
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            out = fn(*args, **kwargs)
            results.put(("ok", rank, out))
            # every rank is past the case's group creations before any destroys a group whose
            # sockets another rank may still be connecting (``initialize_model_parallel``'s
            # barrier covers the groups a mesh makes; this one those a case makes itself). The
            # result goes first, so a rank blocked in the case is the one a timeout names.
            dist.barrier()
            _destroy_subgroups(dist)
            results.put(("threads", rank, _thread_count()))
        except BaseException:  # noqa: BLE001 - reported to the parent with the rank
            _destroy_subgroups(dist)
            results.put(("error", rank, traceback.format_exc()))
    dist.destroy_process_group()


def _thread_count() -> int:
    """This process's threads (Linux), or 0 where /proc does not tell."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


def _destroy_subgroups(dist) -> None:
    """Destroy every process group but the world one, so cases do not accumulate gloo contexts."""
    world = dist.group.WORLD
    for pg in list(dist.distributed_c10d._world.pg_map.keys()):
        if pg is not world:
            dist.destroy_process_group(pg)


def _comparable(env) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in _PER_TEST_ENV}


def _context():
    """The fork server's context when this environment is the one it imported torch under (the
    import-time reads of torch, triton and megalite are then those of a spawned process), else
    spawn. The first call starts the server."""
    env = _comparable(os.environ)
    if "env" not in _FORKSERVER:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload([PRELOAD])
        multiprocessing.forkserver.ensure_running()
        _FORKSERVER["env"] = env
        return ctx
    return mp.get_context("forkserver" if env == _FORKSERVER["env"] else "spawn")


class WorkerPool:
    def __init__(self, world_size: int, timeout: float = DEFAULT_TIMEOUT):
        ctx = _context()
        self.world_size = world_size
        self._tmp = tempfile.mkdtemp(prefix="megalite-harness-")
        init_file = os.path.join(self._tmp, "rendezvous")
        env = dict(os.environ)
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(r, world_size, init_file, self._tasks[r], self._results, timeout, env),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self.threads = 0  # the most threads a worker reported after its last case

    def run(self, fn, args, kwargs, timeout: float) -> list:
        __tracebackhide__ = True
        for q in self._tasks:
            q.put((fn, args, kwargs))
        outs: dict[int, object] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while len(outs) + len(errors) < self.world_size:
            if errors:  # give the other ranks a moment to report theirs, then stop waiting
                deadline = min(deadline, time.monotonic() + 2.0)
            try:
                kind, rank, payload = self._results.get(timeout=0.2)
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                if dead and not errors:
                    self.close(kill=True)
                    raise DistributedCaseError(
                        f"{fn.__name__}: rank(s) {dead} died (exit codes "
                        f"{[self._procs[r].exitcode for r in dead]})"
                    ) from None
                if time.monotonic() > deadline:
                    break
                continue
            if kind == "threads":  # after a case's groups are gone (maybe the previous case's)
                self.threads = max(self.threads, payload)
            elif kind == "ok":
                outs[rank] = payload
            else:
                errors[rank] = payload
        if errors or len(outs) < self.world_size:
            # a rank that died (killed, out of memory) reports nothing: its peers only see a closed
            # socket, so name it and its exit code beside their errors
            dead = {r: p.exitcode for r, p in enumerate(self._procs) if not p.is_alive()}
            self.close(kill=True)
            if errors:
                first = min(errors)
                others = sorted(set(errors) - {first})
                # the lowest rank's traceback, and every failing rank's last line: the root cause
                # is often on another rank than the first to report (a peer sees a closed socket)
                summary = "".join(
                    f"\n  rank {r}: {errors[r].strip().splitlines()[-1][:300]}"
                    for r in sorted(errors)
                )
                raise DistributedCaseError(
                    f"{fn.__name__} failed on rank {first} of {self.world_size}"
                    + (f" (also on ranks {others})" if others else "")
                    + (
                        f"; rank(s) {sorted(dead)} had died (exit codes {list(dead.values())})"
                        if dead
                        else ""
                    )
                    + f":{summary}\n\nrank {first}:\n{errors[first]}"
                )
            silent = sorted(set(range(self.world_size)) - set(outs))
            raise DistributedCaseError(
                f"{fn.__name__}: rank(s) {silent} of {self.world_size} did not finish within "
                f"{timeout:.0f} s (blocked in a collective?)"
            )
        return [outs[r] for r in range(self.world_size)]

    def alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)

    def close(self, kill: bool = False) -> None:
        if not kill:
            for q in self._tasks:
                q.put(None)
            for p in self._procs:
                p.join(timeout=10)
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        shutil.rmtree(self._tmp, ignore_errors=True)


_POOLS: dict[int, WorkerPool] = {}


def _pool(world_size: int) -> WorkerPool:
    pool = _POOLS.get(world_size)
    if pool is not None and (not pool.alive() or pool.threads > MAX_WORKER_THREADS):
        _POOLS.pop(world_size)
        pool.close(kill=not pool.alive())
        pool = None
    if pool is None:
        while len(_POOLS) >= MAX_POOLS:
            _POOLS.pop(next(iter(_POOLS))).close()
        pool = _POOLS[world_size] = WorkerPool(world_size)
    else:  # most recently used last
        _POOLS[world_size] = _POOLS.pop(world_size)
    return pool


def run_distributed(fn, world_size: int, *args, timeout: float = DEFAULT_TIMEOUT, **kwargs) -> list:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return the per-rank results."""
    __tracebackhide__ = True
    pool = _pool(world_size)
    try:
        return pool.run(fn, args, kwargs, timeout)
    except DistributedCaseError:
        _POOLS.pop(world_size, None)
        raise


def shutdown_pools() -> None:
    while _POOLS:
        _POOLS.popitem()[1].close()


atexit.register(shutdown_pools)

"""Run several scripts one after another in this one interpreter, each as ``python SCRIPT ARGS``.

    python -m tests.tools.run_scripts OUT_DIR SPEC_JSON

``SPEC_JSON`` is a list of ``[name, script_path, [args...]]``. Each script runs through
``runpy.run_path(..., run_name="__main__")`` with its own ``sys.argv``, ``sys.path[0]`` (its
folder), working directory ``OUT_DIR/name`` and torch's start-up seed; its output (file
descriptors 1 and 2) goes to ``OUT_DIR/name/output.txt`` and its exit status to
``OUT_DIR/name/status`` (what ``python SCRIPT`` would exit with: ``sys.exit``'s code, 1 for an
exception); its CPU seconds, its workers' included, are printed. A default process group left
open is destroyed before the next script runs.

Under ``runpy`` the script is ``__main__`` with its own ``__file__``, so a worker started with the
``spawn`` method re-imports it as from ``python SCRIPT``. Here the ``spawn`` method is served by a
fork server (``multiprocessing``'s ``forkserver``) that has imported torch and megalite once: a
worker is forked from it, then prepared as a spawned one (the script imported as
``__mp_main__``, the parent's ``sys.path`` and working directory, the target unpickled), without
importing torch again. It inherits the server's environment and output: the workers' output of
every script is in ``OUT_DIR/workers.txt``, after a line ``=== run_scripts: NAME ===`` for
each script.
"""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.context
import multiprocessing.forkserver
import os
import resource
import runpy
import sys
import traceback

import torch
import torch.distributed as dist

# what the fork server imports once, for every worker: what the test harness's workers start with
# (torch, torch._dynamo, megalite: tests/worker_preload.py), and the torch.distributed packages the
# benchmarks' workers import (0.1-1 s each)
PRELOAD = [
    "tests.worker_preload",
    "torch.multiprocessing",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.distributed.optim",
    "torch.distributed.pipelining",
    "torch.distributed.tensor.parallel",
]


def serve_spawn_from_fork_server(output: str) -> None:
    """Start the fork server (its output: ``output``, appended) and make it serve ``spawn``."""
    server = multiprocessing.get_context("forkserver")
    server.set_forkserver_preload(PRELOAD)
    saved = os.dup(1), os.dup(2)
    with open(output, "a") as f:
        os.dup2(f.fileno(), 1), os.dup2(f.fileno(), 2)
        try:
            multiprocessing.forkserver.ensure_running()
        finally:
            os.dup2(saved[0], 1), os.dup2(saved[1], 2)
    multiprocessing.context._concrete_contexts["spawn"] = server


def cpu_seconds() -> float:
    """CPU seconds so far of this process, its waited-for children and the fork server's workers
    (user + system; a worker's count once the server has reaped it, as it does at its exit)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime
    pid = multiprocessing.forkserver._forkserver._forkserver_pid
    if pid is not None:  # /proc/PID/stat fields 14-17: utime stime cutime cstime, in ticks
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")
    return total


def run_one(path: str, args: list[str], seed: int) -> int:
    """``path``'s exit status, as ``python path *args`` would exit."""
    argv, sys_path = sys.argv, list(sys.path)
    sys.argv = [path, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(path))
    torch.manual_seed(seed)
    try:
        runpy.run_path(path, run_name="__main__")
        return 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)  # sys.exit("message"): printed, status 1
        return 1
    except BaseException:  # noqa: BLE001 - the script's failure is its status, the next one runs
        traceback.print_exc()
        return 1
    finally:
        sys.argv, sys.path[:] = argv, sys_path
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def main() -> None:
    out_dir, spec = sys.argv[1], json.loads(sys.argv[2])
    seed = torch.initial_seed()  # a fresh interpreter's: what each script would start from
    workers = os.path.join(out_dir, "workers.txt")
    serve_spawn_from_fork_server(workers)
    cwd, saved = os.getcwd(), (os.dup(1), os.dup(2))
    try:
        for name, path, args in spec:
            with open(workers, "a") as f:
                f.write(f"=== run_scripts: {name} ===\n")
            work = os.path.join(out_dir, name)
            os.makedirs(work, exist_ok=True)
            start = cpu_seconds()
            with open(os.path.join(work, "output.txt"), "w") as out:
                sys.stdout.flush(), sys.stderr.flush()
                os.dup2(out.fileno(), 1), os.dup2(out.fileno(), 2)
                os.chdir(work)
                try:
                    status = run_one(path, args, seed)
                finally:
                    sys.stdout.flush(), sys.stderr.flush()
                    os.dup2(saved[0], 1), os.dup2(saved[1], 2)
                    os.chdir(cwd)
            with open(os.path.join(work, "status"), "w") as f:
                f.write(str(status))
            print(f"{name}: exit {status}, {cpu_seconds() - start:.2f} CPU seconds", flush=True)
    finally:  # stop the server and wait for it: its workers' CPU time is then this process's
        multiprocessing.forkserver._forkserver._stop()


if __name__ == "__main__":
    main()

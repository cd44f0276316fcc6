"""No process group of a run outlives ``pretrain``: when it returns, the world it made and every
group of its mesh are destroyed, and with them their gloo worker threads.

A group alive at interpreter exit keeps its worker threads running into shutdown, and a worker
may still hold the last reference to a finished collective's tensor; releasing it takes the GIL,
and Python 3.11 ends a thread that takes the GIL during shutdown inside the noexcept C++
destructor it is in: the process aborts (``terminate called without an active exception``,
SIGABRT) after a run that succeeded. Two things kept groups alive: reference cycles that the
garbage collector freed only at exit (``pretrain`` collects them before it returns), and the
world group pinned by ``torch.distributed.nn``'s ``group=group.WORLD`` defaults when torch
imported that module lazily inside the world (``megalite.core.parallel_state`` imports it first).

The run is a plain process (a world of 1 over gloo) in a fresh interpreter: in this one another
test may have imported ``torch.distributed.nn`` already, and the collector runs at any time. The
child switches the automatic collector off, so only ``pretrain``'s own collection counts.
"""

from __future__ import annotations

import os
import subprocess
import sys

from tests.paths import ROOT

CHILD = """
import gc, weakref
import torch.distributed as dist
from megalite.training.pretrain import pretrain
from tests.training.common import config

groups = []
new_group, init_process_group = dist.new_group, dist.init_process_group

def record(name, group):
    if isinstance(group, dist.ProcessGroup):
        groups.append((name, weakref.ref(group)))

def watched_new_group(ranks=None, *args, **kwargs):
    group = new_group(ranks, *args, **kwargs)
    record(f"group {ranks}", group)
    return group

def watched_init(*args, **kwargs):
    init_process_group(*args, **kwargs)
    record("world", dist.group.WORLD)

dist.new_group, dist.init_process_group = watched_new_group, watched_init
gc.disable()
result = pretrain(config("--train-iters", "2"), env={})
assert result.iteration == 2 and groups
print("ALIVE", [name for name, ref in groups if ref() is not None])
"""


def test_no_process_group_of_a_run_outlives_pretrain():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    alive = [line for line in proc.stdout.splitlines() if line.startswith("ALIVE")]
    assert alive == ["ALIVE []"], proc.stdout[-3000:] + proc.stderr[-3000:]

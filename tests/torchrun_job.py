"""Ending a ``torchrun`` job a test started, and asking its ranks where they are.

torchrun starts each rank in a session of its own, so killing the launcher's process group leaves
the ranks running, parented to init, once the launcher is gone. A test that ends a job (a check
failed, a guard ran out) therefore finds the ranks first, while they are still the launcher's
children, and kills each.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import subprocess
import time


def _parents() -> dict[int, int]:
    """pid -> parent pid of every live process, from /proc."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()  # the name may hold spaces
            except OSError:
                continue
            parents[int(entry)] = int(fields[1])  # after the name: state, ppid
    return parents


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (torchrun's ranks and whatever they started)."""
    children: dict[int, list[int]] = {}
    for child, parent in _parents().items():
        children.setdefault(parent, []).append(child)
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def signal_all(pids: list[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def end_job(proc: subprocess.Popen) -> None:
    """Kill the launcher, its process group and every rank below it; wait for the launcher."""
    ranks = descendants(proc.pid)
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    signal_all(ranks, signal.SIGKILL)
    proc.wait(timeout=30)


def dump_stacks(proc: subprocess.Popen, settle: float = 2.0) -> list[int]:
    """SIGUSR1 to every rank below the launcher (ranks that registered ``faulthandler`` for it
    print each thread's stack to their stderr); returns the pids asked."""
    ranks = descendants(proc.pid)
    signal_all(ranks, signal.SIGUSR1)
    time.sleep(settle)
    return ranks


def answer_stack_requests() -> None:
    """In a rank (a test's wrapper of ``pretrain_gpt.py``): SIGUSR1 prints every thread's stack
    to stderr, so ``dump_stacks`` can show where a stalled job is."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)


if __name__ == "__main__":  # a rank that only waits: the job ``tests/test_torchrun_job.py`` ends
    answer_stack_requests()
    print(f"rank {os.environ.get('RANK')} waiting (pid {os.getpid()})", flush=True)
    while True:
        time.sleep(0.1)

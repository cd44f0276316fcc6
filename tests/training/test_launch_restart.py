"""A restarted torchrun attempt joins its own world, not the dead attempt's.

torchrun's c10d rendezvous keeps one store for the whole job and gives it to every attempt
(``TORCHELASTIC_USE_AGENT_STORE=True``). Without a per-attempt key prefix, a rank of attempt 1
can read its peer's gloo address from attempt 0 and fail (``connectFullMesh ... Connection
refused``), which made automatic restarts fail on a loaded machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta

import pytest
import torch.distributed as dist

from megalite.training.launch import LaunchInfo, attempt_store
from tests.paths import ROOT

WORKER = ROOT / "tests" / "training" / "attempt_worker.py"


def _env(server: dist.TCPStore, rank: int, attempt: int, slow_rank: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(
        RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(server.port),
        TORCHELASTIC_USE_AGENT_STORE="True",
        TORCHELASTIC_RESTART_COUNT=str(attempt),
        SLOW_RANK=str(slow_rank),
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(ROOT),
    )
    return env


def _start(server, attempt, slow_rank):
    return [
        subprocess.Popen(
            [sys.executable, str(WORKER)],
            env=_env(server, rank, attempt, slow_rank),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]


def test_each_attempt_has_its_own_keys():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True)
    launch = LaunchInfo("torchrun", 0, 1, 0, "127.0.0.1", server.port)
    timeout = timedelta(seconds=30)
    env = {"TORCHELASTIC_USE_AGENT_STORE": "True"}
    first = attempt_store(launch, {**env, "TORCHELASTIC_RESTART_COUNT": "0"}, timeout)
    second = attempt_store(launch, {**env, "TORCHELASTIC_RESTART_COUNT": "1"}, timeout)
    first.set("rank_0", "old address")
    assert first.check(["rank_0"]) and not second.check(["rank_0"])
    assert attempt_store(launch, {}, timeout) is None  # no shared store: env:// as before


@pytest.mark.parametrize("slow_rank", [0, 1])
def test_a_restarted_attempt_joins_although_the_dead_attempt_left_its_addresses(slow_rank):
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True)
    first = _start(server, 0, slow_rank)
    try:
        for p in first:
            assert p.stdout.readline().strip().endswith("sum 3"), "attempt 0 did not run"
    finally:
        for p in first:  # as torchrun kills the ranks of a failed attempt
            p.kill()
            p.wait()
    second = _start(server, 1, slow_rank)
    outs = []
    for p in second:
        try:
            out, _ = p.communicate(timeout=600)  # a hang guard only
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
        outs.append(out)
    for rank, (p, out) in enumerate(zip(second, outs)):
        assert p.returncode == 0 and f"attempt 1 rank {rank} sum 3" in out, out[-3000:]

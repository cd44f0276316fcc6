"""Launch detection (torchrun, srun without torchrun, one plain process), SLURM host lists, and a
real 2-process srun-style run of ``pretrain_gpt.py`` (no torchrun, no scontrol)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from megalite.training.launch import LaunchInfo, detect_launch, expand_nodelist, first_slurm_host
from tests.paths import ROOT
from tests.training.common import BASE


def test_torchrun_environment():
    env = {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "h",
        "MASTER_PORT": "9",
    }
    env["SLURM_PROCID"] = "0"  # torchrun inside an allocation: torchrun's variables win
    env["SLURM_NTASKS"] = "1"
    assert detect_launch(env) == LaunchInfo("torchrun", 3, 4, 1, "h", 9)


def test_srun_environment_master_from_nodelist():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1"}
    env["SLURM_NODELIST"] = "gpu[007-009,012],cpu5"
    info = detect_launch(env)
    assert info == LaunchInfo("srun", 5, 8, 1, "gpu007", 29500)
    assert detect_launch({**env, "MASTER_PORT": "6000"}).master_port == 6000
    assert detect_launch({**env, "MASTER_ADDR": "head"}).master_addr == "head"


def test_plain_process_and_bad_values():
    assert detect_launch({}) == LaunchInfo("single", 0, 1, 0, None, None)
    with pytest.raises(ValueError, match="RANK='x' is not an integer"):
        detect_launch({"RANK": "x", "WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match="SLURM_NODELIST is not set"):
        detect_launch({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"})


def test_expand_nodelist_compact_forms():
    assert expand_nodelist("node1") == ["node1"]
    assert expand_nodelist("gpu[01-03,07],cpu5") == ["gpu01", "gpu02", "gpu03", "gpu07", "cpu5"]
    assert expand_nodelist("a[1-2]b[3-4]") == ["a1b3", "a1b4", "a2b3", "a2b4"]
    assert expand_nodelist("x-[9-11],y") == ["x-9", "x-10", "x-11", "y"]
    assert first_slurm_host("rack[2-3]-n[0-1]") == "rack2-n0"  # no scontrol here: our parser


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_srun_style_two_processes_train_without_torchrun():
    port = str(_free_port())
    procs = []
    for rank in range(2):
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
        env.update(
            SLURM_PROCID=str(rank),
            SLURM_NTASKS="2",
            SLURM_LOCALID=str(rank),
            SLURM_NODELIST="localhost",
            MASTER_PORT=port,
            OMP_NUM_THREADS="1",
            PYTHONPATH=str(ROOT),
        )
        argv = [*BASE, "--tensor-model-parallel-size", "2", "--train-iters", "2"]
        argv += ["--log-interval", "1", "--device", "cpu"]
        procs.append(
            subprocess.Popen(
                [sys.executable, str(ROOT / "pretrain_gpt.py"), *argv],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    out = outs[1][0]  # the last rank logs
    assert "world 2 = TP 2 x PP 1 x DP 1 on cpu (gloo)" in out
    assert " iteration        2/       2 |" in out
    assert " iteration " not in outs[0][0]

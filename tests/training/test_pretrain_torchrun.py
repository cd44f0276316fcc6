"""End to end: ``torchrun --nproc-per-node 4 pretrain_gpt.py`` at TP 2 x DP 2 with sequence
parallel on CPU (gloo), mock data, a few iterations: exit 0, the Megatron-shaped lines from the
last rank only, evaluation lines, and the logged losses equal those of the same flags run in one
plain process here (relative 1e-5; the log prints 7 significant digits)."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys

import pytest

from megalite.training.pretrain import pretrain
from tests.paths import ROOT
from tests.training.common import BASE, FAMILIES, config

FLAGS = [
    *BASE,
    *FAMILIES["llama"],
    *"--train-iters 4 --log-interval 2 --eval-interval 2 --eval-iters 1".split(),
]
LOSS = re.compile(r" iteration +(\d+)/ +4 \|.* lm loss: ([0-9.E+-]+) \|")


@pytest.mark.slow
def test_torchrun_four_processes_tp2_dp2():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    layout = "--tensor-model-parallel-size 2 --sequence-parallel".split()
    cmd = [*torchrun, "4", str(ROOT / "pretrain_gpt.py"), *FLAGS, *layout]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "world 4 = TP 2 x PP 1 x DP 2 on cpu (gloo)" in out
    logged = {int(i): float(v) for i, v in LOSS.findall(out)}
    assert sorted(logged) == [2, 4], out  # one line per interval, from one rank only
    assert out.count("validation loss at iteration 2 |") == 1
    assert "validation loss at iteration 4 on test set |" in out
    assert "Traceback" not in proc.stderr

    root = logging.getLogger("megalite")
    saved = (list(root.handlers), root.level, root.propagate)
    try:
        single = pretrain(config(*FLAGS[len(BASE) :]), env={}).losses
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
        root.propagate = saved[2]
    for it, value in logged.items():
        want = sum(single[it - 2 : it]) / 2  # the interval's mean
        assert abs(value - want) <= 1e-5 * want, (it, value, want)

"""Automatic restart: torchrun ``--max-restarts 1`` restarts a 2-rank job (TP 2) whose rank 1 is
killed (SIGKILL) as iteration 5 begins; the new attempt finds no ``--load`` in its flags, resumes
from ``--save`` (the launcher's restart count says it is a restart) at iteration 4, the newest
complete checkpoint, and finishes iterations 5 and 6 with the losses of an uninterrupted run
(one process, TP 1: 1e-5 relative, the order of sums only; read from the ``%.6E`` progress lines,
7 significant digits).

Opt-in (``MEGALITE_TEST_RESTART=1``): on a heavily loaded machine the restarted attempt's gloo
world sometimes fails to connect (``connectFullMesh ... Connection refused``) before megalite
runs a line; until that is understood the test does not run by default.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from megalite.checkpoint import read_tracker
from megalite.training.pretrain import pretrain
from tests.paths import ROOT
from tests.torchrun_job import dump_stacks, end_job
from tests.training.common import BASE, assert_close_rel, config

LOSS = re.compile(r" iteration\s+(\d+)/\s*\d+ \|.*?lm loss: (\S+) \|")


@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get("MEGALITE_TEST_RESTART"), reason="opt-in: MEGALITE_TEST_RESTART=1"
)
def test_a_killed_rank_restarts_from_the_newest_checkpoint_and_continues(tmp_path):
    save = tmp_path / "ckpt"
    flags = ["--train-iters", "6", "--save", str(save), "--save-interval", "2"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), MEGALITE_TEST_DIE_AT_ITERATION="5@1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--max-restarts", "1"]
    cmd += ["--monitor-interval", "0.5", "--nproc-per-node", "2"]
    cmd += [str(ROOT / "tests" / "training" / "die_at_iteration.py"), *BASE, *flags]
    cmd += ["--tensor-model-parallel-size", "2", "--log-interval", "1"]
    # Output goes to files (not pipes), so a hang's output is kept: at the guard the test asks the
    # ranks for their stacks, kills the job and shows what the two attempts printed up to then.
    log, err = tmp_path / "torchrun.log", tmp_path / "torchrun.err"
    with open(log, "w") as out_f, open(err, "w") as err_f:
        proc = subprocess.Popen(
            cmd, stdout=out_f, stderr=err_f, env=env, cwd=ROOT, start_new_session=True, text=True
        )
        try:
            returncode = proc.wait(timeout=600)
        except subprocess.TimeoutExpired:
            dump_stacks(proc)
            returncode = None
        finally:
            end_job(proc)
    stdout, stderr = log.read_text(), err.read_text()
    out = stdout + stderr
    assert returncode == 0, (
        f"torchrun exit {returncode} (None: killed at the 600 s guard)\n{out[-4000:]}"
    )
    assert "rank 1 dies at iteration 5" in out
    assert "restart 1 of this job: resuming from --save" in out
    assert re.search(r"loaded checkpoint \S+iter_0000004 ", out), out[-4000:]
    assert read_tracker(str(save)) == 6
    # stdout holds both attempts' progress lines (stderr, read after it, the kill): the restarted
    # attempt's are those after its load line
    _, after = re.split(r"loaded checkpoint \S+iter_0000004 ", stdout, maxsplit=1)
    losses = {int(i): float(v) for i, v in LOSS.findall(after)}
    assert sorted(losses) == [5, 6], out[-4000:]
    straight = pretrain(config("--train-iters", "6"), env={})
    assert_close_rel([losses[5], losses[6]], straight.losses[4:], 1e-5, "after the restart")

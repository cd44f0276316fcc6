"""Crash safety: a rank killed with SIGKILL in the middle of a save leaves the previous checkpoint.

``torchrun`` runs 2 ranks (TP 2) for 6 iterations saving every 2, through ``pause_in_save.py``:
``MEGALITE_TEST_PAUSE_IN_SAVE`` makes the save of iteration 4 pause after each rank has written and
fsynced its shard, before the tracker is replaced; the test kills one rank with SIGKILL there
(torchrun then ends the other). The tracker must still name iteration 2 although iteration 4's
shards lie on disk. A new job (one process: TP 1, so the load also reshards) resumes from
iteration 2 into the same directory, saves iteration 4 afresh (the uncommitted TP-2 shards are
removed first), finishes at 6, and its losses equal a straight 6-iteration run's last 4 (1e-5
relative: TP 2 and TP 1 differ in the order of sums only).
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from megalite.checkpoint.files import read_tracker
from megalite.training.pretrain import pretrain
from tests.paths import ROOT
from tests.training.common import BASE, assert_close_rel, config

PAUSE = re.compile(
    r"MEGALITE_TEST_PAUSE_IN_SAVE: pausing \S+ s in the save of iteration 4 \(pid (\d+)\)"
)


def _reader(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)


@pytest.mark.slow
def test_sigkill_during_a_save_keeps_the_previous_checkpoint(tmp_path):
    save = tmp_path / "ckpt"
    flags = ["--train-iters", "6", "--save", str(save), "--save-interval", "2"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), MEGALITE_TEST_PAUSE_IN_SAVE="300@4")
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    script = ROOT / "tests" / "checkpoint" / "pause_in_save.py"
    cmd = [*launcher, "2", str(script), *BASE, *flags]
    cmd += ["--tensor-model-parallel-size", "2"]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_reader, args=(proc.stdout, lines), daemon=True).start()
    pids, seen = [], []
    deadline = time.monotonic() + 240
    try:
        while len(pids) < 2 and time.monotonic() < deadline:
            try:
                line = lines.get(timeout=1.0)
            except queue.Empty:
                continue
            if line is None:
                break
            seen.append(line)
            # two ranks print at once: their lines can share one line of the pipe
            pids += [int(m.group(1)) for m in PAUSE.finditer(line)]
        assert len(pids) == 2, "the ranks never paused in the save:\n" + "".join(seen[-40:])
        assert read_tracker(str(save)) == 2  # iteration 4 is being saved, not yet committed
        os.kill(pids[1], signal.SIGKILL)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    assert read_tracker(str(save)) == 2
    iter4 = save / "iter_0000004"
    assert (iter4 / "mp_rank_00" / "model_optim_rng.pt").is_file()  # written, never committed
    assert (iter4 / "mp_rank_01" / "model_optim_rng.pt").is_file()

    resumed = pretrain(config(*flags, "--load", str(save)), env={})
    straight = pretrain(config("--train-iters", "6"), env={})
    assert resumed.iteration == 6 and len(resumed.losses) == 4
    assert_close_rel(resumed.losses, straight.losses[2:], 1e-5, "resumed after SIGKILL")
    assert read_tracker(str(save)) == 6
    assert sorted(os.listdir(iter4)) == ["mp_rank_00"]  # the stale TP-2 shards were cleared

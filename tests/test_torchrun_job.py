"""The tests' handling of a torchrun job: a stalled job's ranks print their stacks when asked, and
ending the job ends its ranks too (torchrun starts each in a session of its own)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

from tests.paths import ROOT
from tests.torchrun_job import descendants, dump_stacks, end_job

WAITING = re.compile(r"rank (\d) waiting \(pid (\d+)\)")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except OSError:
        return False


def test_a_stalled_job_shows_its_stacks_and_ending_it_leaves_no_rank(tmp_path):
    log = tmp_path / "log.txt"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = str(ROOT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += ["-m", "tests.torchrun_job"]
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 300
        while len(WAITING.findall(log.read_text())) < 2 and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()
            time.sleep(0.1)
        ranks = {int(pid) for _, pid in WAITING.findall(log.read_text())}
        assert len(ranks) == 2, log.read_text()
        assert ranks <= set(descendants(proc.pid))
        # each rank runs in a session of its own: the launcher's group does not hold them
        assert all(os.getsid(pid) != proc.pid for pid in ranks)

        asked = set(dump_stacks(proc))
        assert ranks <= asked
        text = log.read_text()
        assert text.count("Current thread") + text.count("Thread 0x") >= 2, text
        assert "tests/torchrun_job.py" in text, text
    finally:
        end_job(proc)
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in ranks if _alive(pid)], "ranks outlived end_job"

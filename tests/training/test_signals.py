"""``--exit-signal-handler`` and rank death, under torchrun on CPU (gloo).

Unit level: signal names parse (and uncatchable ones are refused), the handler only sets a flag and
restores the old action, and ``any_rank_signalled`` is True on every rank when one rank alone got
the signal (either one of two: a local read would disagree across ranks).

End to end (``torchrun --nproc-per-node 2 pretrain_gpt.py``, PP 2, so the two ranks hold different
stages): SIGTERM sent by pid to rank 0 only (the logging rank is rank 1) stops the run at an
iteration boundary: exit 0, one "exiting program at iteration k" line, the tracker names k and the
folder of k holds both stages' shards (so both ranks saved at the same k), and no iteration after
k was logged. A rank SIGKILLed in the middle of a save (the checkpoint files of iteration 4
written, the tracker not yet replaced; ``MEGALITE_TEST_PAUSE_IN_SAVE``) ends the job promptly with
a non-zero status, and the tracker still names the previous checkpoint (2). "Promptly" without a
clock: the collective timeout is 30 minutes, so a job that ends at all within the test's hang
guard (``HANG_GUARD``, minutes below it) ended by the signal or by torchrun, not by a timeout.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from megalite.training.config import ConfigError
from megalite.training.signals import ExitSignalHandler, any_rank_signalled, parse_signal
from tests.harness import run_distributed
from tests.paths import ROOT
from tests.torchrun_job import dump_stacks, end_job
from tests.training.common import BASE, config

TRACKER = "latest_checkpointed_iteration.txt"


def test_parse_signal_names_numbers_and_errors():
    assert parse_signal("SIGUSR1") is signal.SIGUSR1
    assert parse_signal("usr2") is signal.SIGUSR2
    assert parse_signal(str(int(signal.SIGTERM))) is signal.SIGTERM
    with pytest.raises(ValueError, match="cannot be caught"):
        parse_signal("KILL")
    with pytest.raises(ValueError, match="'SIGNOPE' is not a signal"):
        parse_signal("SIGNOPE")
    cfg = config("--exit-signal-handler", "--exit-signal", "USR1")
    assert cfg.training.exit_signal_handler and cfg.training.exit_signal == "SIGUSR1"
    assert not config().training.exit_signal_handler  # off unless asked
    with pytest.raises(ConfigError, match="--exit-signal 'bogus' is not a signal"):
        config("--exit-signal-handler", "--exit-signal", "bogus")


def test_handler_sets_a_flag_and_restores_the_previous_action():
    seen = []
    previous = signal.signal(signal.SIGUSR1, lambda *_: seen.append(1))
    try:
        with ExitSignalHandler(signal.SIGUSR1) as handler:
            assert not handler.received
            os.kill(os.getpid(), signal.SIGUSR1)
            os.kill(os.getpid(), signal.SIGUSR1)  # a second one (a forwarding launcher) is fine
            assert handler.received and seen == []
        os.kill(os.getpid(), signal.SIGUSR1)  # the old handler is back
        assert seen == [1]
    finally:
        signal.signal(signal.SIGUSR1, previous)


def _agree(flagged: int | None) -> bool:
    import torch

    return any_rank_signalled(
        dist.get_rank() == flagged, group=dist.group.WORLD, device=torch.device("cpu")
    )


def test_any_rank_signalled_agrees_across_ranks():
    assert run_distributed(_agree, 2, 0) == [True, True]
    assert run_distributed(_agree, 2, 1) == [True, True]
    assert run_distributed(_agree, 2, None) == [False, False]


# -- end to end under torchrun -------------------------------------------------------------------
FLAGS = [
    *BASE,
    *"--pipeline-model-parallel-size 2 --train-iters 100000 --log-interval 1".split(),
    *"--exit-signal-handler --distributed-timeout-minutes 30".split(),
]
# A run that ends within this hang guard ended by the signal (or by torchrun on a rank's death),
# not by the 30-minute collective timeout a rank that missed it would wait for.
HANG_GUARD = 600
ITERATION = re.compile(r" iteration +(\d+)/ *100000 \|")


def _start(tmp_path: Path, *extra: str, env_extra: dict | None = None):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **(env_extra or {}))
    log = tmp_path / "log.txt"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    save = ["--save", str(tmp_path / "ckpt")]
    # pretrain_gpt.py through a wrapper that can pause in a save (MEGALITE_TEST_PAUSE_IN_SAVE)
    entry = ROOT / "tests" / "checkpoint" / "pause_in_save.py"
    cmd = [*launcher, "2", str(entry), *FLAGS, *save, *extra]
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
        )
    return proc, log


def _wait_for(
    proc: subprocess.Popen, log: Path, pattern: str, timeout: float = HANG_GUARD
) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = re.search(pattern, log.read_text(errors="replace"))
        if m:
            return m
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    raise AssertionError(
        f"no {pattern!r} in the log (rc {proc.poll()}):\n{log.read_text()[-3000:]}"
    )


def _worker_pids(launcher_pid: int) -> dict[int, int]:
    """rank -> pid of torchrun's workers (its children), from /proc."""
    kids = Path(f"/proc/{launcher_pid}/task/{launcher_pid}/children").read_text().split()
    ranks = {}
    for pid in map(int, kids):
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        rank = [e for e in environ if e.startswith(b"RANK=")]
        if rank:
            ranks[int(rank[0][5:])] = pid
    return ranks


def _finish(proc: subprocess.Popen, timeout: float) -> int:
    """The launcher's exit code, or -999 when it ran past ``timeout`` (the ranks' stacks are then
    in the log); never leaves the launcher or its ranks behind."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        if timeout > 0:
            dump_stacks(proc)
        return -999
    finally:
        end_job(proc)


@pytest.mark.slow
def test_sigterm_to_one_rank_stops_every_rank_at_one_iteration_saved(tmp_path):
    proc, log = _start(tmp_path)
    try:
        _wait_for(proc, log, r" iteration +3/")
        pids = _worker_pids(proc.pid)
        assert sorted(pids) == [0, 1], pids
        os.kill(pids[0], signal.SIGTERM)  # rank 0 only: rank 1 logs and must follow
        rc = _finish(proc, timeout=HANG_GUARD)
    finally:
        _finish(proc, timeout=0)
    out = log.read_text()
    assert rc == 0, out[-3000:]  # -999: still running after the hang guard
    (k,) = map(int, re.findall(r"exiting program at iteration (\d+): SIGTERM received", out))
    logged = sorted(int(i) for i in ITERATION.findall(out))
    assert logged[-1] == k and logged == list(range(1, k + 1)), (k, logged[-5:])
    ckpt = tmp_path / "ckpt"
    assert (ckpt / TRACKER).read_text().strip() == str(k)
    shards = sorted(p.name for p in (ckpt / f"iter_{k:07d}").iterdir())
    assert shards == ["mp_rank_00_000", "mp_rank_00_001"], shards  # both stages saved at k
    for shard in shards:
        assert (ckpt / f"iter_{k:07d}" / shard / "model_optim_rng.pt").stat().st_size > 0
    assert "validation loss" not in out  # no final evaluation after the signal


@pytest.mark.slow
def test_rank_killed_in_a_save_ends_the_job_and_keeps_the_previous_checkpoint(tmp_path):
    proc, log = _start(
        tmp_path, "--save-interval", "2", env_extra={"MEGALITE_TEST_PAUSE_IN_SAVE": "3600@4"}
    )
    try:
        # a rank has written its files of iteration 4 and sleeps before the tracker, for longer
        # than the test lasts: the kill lands in the pause however slow the machine
        _wait_for(proc, log, r"pausing 3600 s in the save of iteration 4\b")
        assert (tmp_path / "ckpt" / TRACKER).read_text().strip() == "2"
        pids = _worker_pids(proc.pid)
        os.kill(pids[1], signal.SIGKILL)  # rank 1 dies; rank 0 (writes the tracker) lives on
        rc = _finish(proc, timeout=HANG_GUARD)
    finally:
        _finish(proc, timeout=0)
    out = log.read_text()
    assert rc not in (0, -999), out[-3000:]  # -999: the job outlived the hang guard
    assert (tmp_path / "ckpt" / TRACKER).read_text().strip() == "2"
    assert (tmp_path / "ckpt" / "iter_0000004").is_dir()  # written, but never named latest
    assert "saved checkpoint at iteration 4" not in out

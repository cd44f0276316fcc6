"""Crash safety of ``--async-save``: a rank lost, a full disk or SIGTERM while a background write is
in flight.

The torchrun cases run 2 ranks (TP 2) for 8 iterations saving every 2 through
``pause_in_async_save.py``: the writer thread of iteration 4's save writes its files and then
waits for a release file, while the loop goes on (the test waits for iteration 5's progress line
before it acts). The uninterrupted run is one process (TP 1: the resume reshards too; 1e-5
relative, as TP 2 and TP 1 differ in the order of sums only).

- SIGKILL or SIGTERM (no handler: the default action) of rank 1: the job fails, the tracker still
  names iteration 2 although iteration 4's shards lie on disk, ``load_model`` reads iteration 2,
  and a new job resumes from it with the uninterrupted run's losses.
- SIGTERM with ``--exit-signal-handler``: the ranks agree at an iteration boundary, the write in
  flight is finished (the test releases it) and committed, the exit's checkpoint is saved, the
  job exits 0, and a resume from it continues the uninterrupted run's losses.
- A full disk in the writer thread (in-process, ``open`` of ``megalite.checkpoint.files``
  replaced as in ``test_checkpoint_faults``): the failure surfaces at the next save as the
  synchronous save's one-line error, the partial iteration is removed, the tracker stays 2.
"""

from __future__ import annotations

import errno
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from megalite.checkpoint import CheckpointError, files, read_tracker
from megalite.inference import load_model
from megalite.training.pretrain import pretrain
from tests.checkpoint.test_checkpoint_faults import _failing_open
from tests.paths import ROOT
from tests.torchrun_job import dump_stacks, end_job
from tests.training.common import BASE, assert_close_rel, config
from tests.user_errors import files_under

FLAGS = ["--train-iters", "8", "--save-interval", "2", "--async-save"]
PAUSE = re.compile(
    r"MEGALITE_TEST_PAUSE_IN_ASYNC_WRITE: paused after writing iteration 4 \(pid (\d+)\)"
)
ITERATION_5 = re.compile(r"iteration\s+5/")


def _reader(stream, lines: queue.Queue, start: float) -> None:
    for line in stream:
        lines.put(f"[{time.monotonic() - start:7.1f}s] {line}")
    lines.put(None)


class PausedJob:
    """The 2-rank torchrun job, its output read in a thread; ``wait_paused`` returns once both
    writers paused after iteration 4's files and the loop reached iteration 5."""

    def __init__(self, save, release, *extra: str):
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
        env.update(
            OMP_NUM_THREADS="1",
            PYTHONPATH=str(ROOT),
            MEGALITE_TEST_PAUSE_IN_ASYNC_WRITE=f"4:{release}",
        )
        script = ROOT / "tests" / "checkpoint" / "pause_in_async_save.py"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += ["--nproc-per-node", "2", str(script), *BASE, *FLAGS, "--save", str(save)]
        cmd += ["--tensor-model-parallel-size", "2", "--log-interval", "1", *extra]
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=ROOT,
            start_new_session=True,
        )
        self.lines: queue.Queue = queue.Queue()
        self.seen: list[str] = []
        args = (self.proc.stdout, self.lines, time.monotonic())
        threading.Thread(target=_reader, args=args, daemon=True).start()

    def wait_paused(self, timeout: float = 600) -> list[int]:
        pids, moved_on = [], False
        deadline = time.monotonic() + timeout
        while (len(pids) < 2 or not moved_on) and time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=1.0)
            except queue.Empty:
                continue
            if line is None:
                break
            self.seen.append(line)
            # two ranks print at once: their lines can share one line of the pipe
            pids += [int(m.group(1)) for m in PAUSE.finditer(line)]
            moved_on = moved_on or ITERATION_5.search(line) is not None
        if len(pids) < 2 or not moved_on:
            self.dump_stacks()
        assert len(pids) == 2 and moved_on, "no pause, or no iteration 5:\n" + self.output()
        return pids

    def dump_stacks(self) -> None:
        """A stalled job says where: every rank prints its threads' stacks into the output."""
        ranks = dump_stacks(self.proc)
        self.drain()
        self.seen.append(f"(the stacks of ranks {ranks}, asked at the guard)\n")

    def drain(self) -> None:
        while True:
            try:
                line = self.lines.get_nowait()
            except queue.Empty:
                break
            if line is not None:
                self.seen.append(line)

    def kill(self) -> None:
        """End torchrun and its ranks at once: a failed check."""
        end_job(self.proc)

    def finish(self, timeout: float = 600) -> int:
        try:
            self.proc.wait(timeout=timeout)
        finally:
            self.kill()
        time.sleep(0.2)  # the reader thread drains the pipe
        self.drain()
        return self.proc.returncode

    def output(self) -> str:
        return "".join(self.seen[-200:])


def resumed_matches_straight(save, start: int) -> None:
    resumed = pretrain(config(*FLAGS, "--save", str(save), "--load", str(save)), env={})
    straight = pretrain(config("--train-iters", "8"), env={})
    assert resumed.iteration == 8 and len(resumed.losses) == 8 - start
    assert_close_rel(resumed.losses, straight.losses[start:], 1e-5, f"resumed at {start}")
    assert read_tracker(str(save)) == 8


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_rank_lost_during_an_async_write_keeps_the_previous_checkpoint(tmp_path, signum):
    save = tmp_path / "ckpt"
    job = PausedJob(save, tmp_path / "never-released")
    try:
        pids = job.wait_paused()
        assert read_tracker(str(save)) == 2  # iteration 4 is written, not committed
        os.kill(pids[1], signum)
    except BaseException:
        job.kill()
        raise
    code = job.finish()
    assert code != 0, job.output()
    assert read_tracker(str(save)) == 2
    iter4 = save / "iter_0000004"
    assert (iter4 / "mp_rank_00" / "model_optim_rng.pt").is_file()  # written, never committed
    assert (iter4 / "mp_rank_01" / "model_optim_rng.pt").is_file()
    assert load_model(str(save)).checkpoint_info["iteration"] == 2
    resumed_matches_straight(save, 2)
    assert sorted(os.listdir(iter4)) == ["mp_rank_00"]  # the stale TP-2 shards were cleared


@pytest.mark.slow
def test_sigterm_with_the_handler_finishes_the_async_write_and_saves(tmp_path):
    save, release = tmp_path / "ckpt", tmp_path / "release"
    job = PausedJob(save, release, "--exit-signal-handler")
    try:
        pids = job.wait_paused()
        os.kill(pids[1], signal.SIGTERM)
        time.sleep(1.0)  # the flag is set; the loop reaches a boundary while the write waits
        assert read_tracker(str(save)) == 2
        release.touch()
    except BaseException:
        job.kill()
        raise
    code = job.finish()
    assert code == 0, job.output()
    exits = re.findall(r"exiting program at iteration (\d+): SIGTERM received", job.output())
    assert exits, job.output()
    stopped = int(exits[0])
    assert 5 <= stopped < 8 and read_tracker(str(save)) == stopped
    assert (save / "iter_0000004" / "mp_rank_01" / "model_optim_rng.pt").is_file()
    resumed_matches_straight(save, stopped)


def test_a_full_disk_in_the_async_writer_stops_at_the_next_save(tmp_path, monkeypatch):
    save = tmp_path / "ckpt"
    monkeypatch.setattr(files, "open", _failing_open("iter_0000004", errno.ENOSPC), raising=False)
    with pytest.raises(CheckpointError) as e:
        pretrain(config(*FLAGS, "--save", str(save)), env={})
    message = str(e.value)
    for needle in ("iteration 4", "no space left", "latest checkpoint stays iteration 2"):
        assert needle in message and "\n" not in message, message
    left = files_under(save)
    assert not [f for f in left if f.endswith(".tmp") or f.startswith("iter_0000004")], left
    assert read_tracker(str(save)) == 2
    monkeypatch.undo()
    assert load_model(str(save)).checkpoint_info["iteration"] == 2
    resumed_matches_straight(save, 2)

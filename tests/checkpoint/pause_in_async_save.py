"""``pretrain_gpt.py`` whose background checkpoint writer stops after writing one save's files.

    MEGALITE_TEST_PAUSE_IN_ASYNC_WRITE=ITERATION:RELEASE_FILE \\
        torchrun --nproc-per-node 2 tests/checkpoint/pause_in_async_save.py --async-save FLAGS...

On every rank, the writer thread of ITERATION's save writes and fsyncs that rank's files, prints
``MEGALITE_TEST_PAUSE_IN_ASYNC_WRITE: paused after writing iteration N (pid P)`` and waits until
RELEASE_FILE exists (at most 300 s) before it returns; meanwhile the training loop goes on, and
the ranks have not agreed that the checkpoint is complete: the tracker names the previous one. A
test kills or signals a rank there by pid; SIGUSR1 prints every thread's stack (a stalled test asks
for them). Production code has no such hook: this wrapper replaces the writer from the outside,
then runs ``pretrain_gpt.py`` as ``__main__``.
"""

from __future__ import annotations

import os
import runpy
import sys
import time

from megalite.checkpoint import async_save
from tests.paths import ROOT
from tests.torchrun_job import answer_stack_requests

ENV = "MEGALITE_TEST_PAUSE_IN_ASYNC_WRITE"


def _pausing(write_pending):
    at, _, release = os.environ[ENV].partition(":")

    def write_then_pause(pending):
        result = write_pending(pending)
        if pending.iteration == int(at):
            print(
                f"{ENV}: paused after writing iteration {pending.iteration} (pid {os.getpid()})",
                file=sys.stderr,
                flush=True,
            )
            deadline = time.monotonic() + 300
            while not os.path.exists(release) and time.monotonic() < deadline:
                time.sleep(0.05)
        return result

    return write_then_pause


if __name__ == "__main__":
    answer_stack_requests()
    if os.environ.get(ENV):
        async_save.write_pending = _pausing(async_save.write_pending)
    sys.argv[0] = str(ROOT / "pretrain_gpt.py")
    runpy.run_path(sys.argv[0], run_name="__main__")

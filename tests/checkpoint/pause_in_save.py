"""``pretrain_gpt.py`` with a pause in the middle of every rank's checkpoint save, for crash tests.

    MEGALITE_TEST_PAUSE_IN_SAVE=SECONDS[@ITERATION] \\
        torchrun --nproc-per-node 2 tests/checkpoint/pause_in_save.py FLAGS...

Each rank sleeps SECONDS on entering ``saving.commit_checkpoint`` of ITERATION's save (of every
save without ``@ITERATION``): its files are written and fsynced, the ranks have not yet agreed that
the checkpoint is complete and the tracker still names the previous one. Before sleeping it prints
``MEGALITE_TEST_PAUSE_IN_SAVE: pausing SECONDS s in the save of iteration N (pid P)``, so that a
test can kill a rank there by pid. Production code has no such hook: this wrapper replaces the
real step function from the outside, then runs ``pretrain_gpt.py`` as ``__main__``.
"""

from __future__ import annotations

import os
import runpy
import sys
import time

from megalite.checkpoint import saving
from tests.paths import ROOT
from tests.torchrun_job import answer_stack_requests

ENV = "MEGALITE_TEST_PAUSE_IN_SAVE"


def _pausing(commit):
    seconds, _, at = os.environ[ENV].partition("@")

    def commit_after_a_pause(save_dir: str, iteration: int, **kwargs):
        if not at or int(at) == iteration:
            print(
                f"{ENV}: pausing {seconds} s in the save of iteration {iteration} "
                f"(pid {os.getpid()})",
                file=sys.stderr,
                flush=True,
            )
            time.sleep(float(seconds))
        return commit(save_dir, iteration, **kwargs)

    return commit_after_a_pause


if __name__ == "__main__":
    answer_stack_requests()  # a stalled test asks for the stacks
    if os.environ.get(ENV):
        saving.commit_checkpoint = _pausing(saving.commit_checkpoint)
    sys.argv[0] = str(ROOT / "pretrain_gpt.py")
    runpy.run_path(sys.argv[0], run_name="__main__")

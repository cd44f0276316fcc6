"""``pretrain_gpt.py`` whose rank R kills itself (SIGKILL) as iteration N begins, on the job's
first attempt only, for the automatic-restart test.

    MEGALITE_TEST_DIE_AT_ITERATION=N@R \\
        torchrun --max-restarts 1 --nproc-per-node 2 tests/training/die_at_iteration.py FLAGS...

The count is of training steps in this process (a resumed process counts from 1 again, so only
the first attempt, ``TORCHELASTIC_RESTART_COUNT=0``, dies). Before dying it prints
``MEGALITE_TEST_DIE_AT_ITERATION: rank R dies at iteration N``. Production code has no such hook:
this wrapper replaces the trainer's step function from the outside, then runs ``pretrain_gpt.py``
as ``__main__``.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys

from megalite.training import trainer
from tests.paths import ROOT
from tests.torchrun_job import answer_stack_requests

ENV = "MEGALITE_TEST_DIE_AT_ITERATION"


def _dying(train_step):
    at, _, rank = os.environ[ENV].partition("@")
    steps = 0

    def step_or_die(*args, **kwargs):
        nonlocal steps
        steps += 1
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if first_attempt and steps == int(at) and os.environ.get("RANK") == rank:
            print(f"{ENV}: rank {rank} dies at iteration {at}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return train_step(*args, **kwargs)

    return step_or_die


if __name__ == "__main__":
    answer_stack_requests()  # a stalled test asks for the stacks
    if os.environ.get(ENV):
        trainer.train_step = _dying(trainer.train_step)
    sys.argv[0] = str(ROOT / "pretrain_gpt.py")
    runpy.run_path(sys.argv[0], run_name="__main__")

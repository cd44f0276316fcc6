"""``pretrain_gpt.py`` that kills itself (SIGKILL) in the middle of the optimizer step of
iteration N, right after the second chunk of offloaded optimizer state is written to its files
(so the files hold a half-updated state), for the crash test of NVMe offload.

    MEGALITE_TEST_DIE_IN_OFFLOAD_WRITE=N python tests/training/die_in_offload_write.py FLAGS...

Before dying it prints ``MEGALITE_TEST_DIE_IN_OFFLOAD_WRITE: dies in iteration N``. Production
code has no such hook: this wrapper replaces the trainer's step function and the store's write
from the outside, then runs ``pretrain_gpt.py`` as ``__main__``.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys

from megalite.core.optimizer.nvme_store import NvmeStore
from megalite.training import trainer
from tests.paths import ROOT

ENV = "MEGALITE_TEST_DIE_IN_OFFLOAD_WRITE"


def _install(at: int) -> None:
    state = {"iteration": 0, "writes": 0}
    train_step, save = trainer.train_step, NvmeStore.save

    def counting_step(*args, **kwargs):
        state["iteration"] += 1
        state["writes"] = 0
        return train_step(*args, **kwargs)

    def save_or_die(self, lo, hi, keys=("master", "exp_avg", "exp_avg_sq")):
        save(self, lo, hi, keys)
        if state["iteration"] == at:
            state["writes"] += 1
            if state["writes"] == 2:
                print(f"{ENV}: dies in iteration {at}", file=sys.stderr, flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

    trainer.train_step = counting_step
    NvmeStore.save = save_or_die


if __name__ == "__main__":
    if os.environ.get(ENV):
        _install(int(os.environ[ENV]))
    sys.argv[0] = str(ROOT / "pretrain_gpt.py")
    runpy.run_path(sys.argv[0], run_name="__main__")

"""A run removes the offload files it created (``pretrain.remove_offload_files``), and only those.

``pretrain`` with ZeRO-3's param shards in files under a directory it makes and the optimizer
state in a directory that holds a user's file, saving a checkpoint: after the first update both
directories hold this run's files (params, their masters' moments); after the run the made
directory is gone, the user's directory holds only the user's file, and the checkpoint is there.
"""

from __future__ import annotations

import os

from megalite.checkpoint.files import read_tracker
from megalite.training.pretrain import FirstStepHook, pretrain
from tests.training.common import config


class ListFiles(FirstStepHook):
    def __init__(self, *directories: str):
        self.directories, self.seen = directories, {}

    def after_first_update(self, trainer) -> None:
        self.seen = {d: sorted(os.listdir(d)) for d in self.directories}


def test_a_run_removes_the_offload_files_it_created(tmp_path):
    params, optim, save = tmp_path / "made" / "param", tmp_path / "optim", tmp_path / "ckpt"
    os.makedirs(optim)
    (optim / "user.txt").write_text("a user's file")
    flags = ("--zero-stage", "3", "--param-offload-dir", str(params))
    flags += ("--optimizer-offload-dir", str(optim), "--train-iters", "2")
    flags += ("--save", str(save), "--save-interval", "2")
    hook = ListFiles(str(params), str(optim))
    pretrain(config(*flags), env={}, first_step_hooks=[hook])
    during = {os.path.splitext(n)[1] for names in hook.seen.values() for n in names}
    assert during == {".param", ".exp_avg", ".exp_avg_sq", ".txt"}, hook.seen
    assert not params.exists() and sorted(os.listdir(optim)) == ["user.txt"]
    assert read_tracker(str(save)) == 2

"""``--non-persistent-save-interval``: frequent saves into a second folder, only the newest kept;
a resume loads the newer of it and ``--load``.

A run of 8 planned iterations stops at 7 (``--exit-interval``) saving persistently every 4 and
non-persistently every 3 (into SAVE/non_persistent): iterations 4 and 7 in SAVE (7: the save at
the end), 3 then 6 in the second folder, 3 removed. A crash after iteration 6 is what leaves SAVE's
tracker at 4: the test writes that tracker back, and a resume must pick iteration 6 and repeat the
uninterrupted run's last two losses exactly; with SAVE's tracker at 7 it picks 7.
"""

from __future__ import annotations

import os

from megalite.checkpoint.files import read_tracker, write_tracker
from megalite.training.pretrain import pretrain
from tests.training.common import LogCapture, config

FLAGS = ["--train-iters", "8", "--save-interval", "4", "--non-persistent-save-interval", "3"]


def test_a_resume_loads_the_newest_of_the_persistent_and_non_persistent_saves(tmp_path):
    save = tmp_path / "ckpt"
    local = save / "non_persistent"
    flags = [*FLAGS, "--save", str(save), "--load", str(save)]
    first = pretrain(config(*flags, "--exit-interval", "7"), env={})
    assert first.iteration == 7 and read_tracker(str(save)) == 7
    assert read_tracker(str(local)) == 6
    assert sorted(os.listdir(local)) == ["iter_0000006", "latest_checkpointed_iteration.txt"]
    assert not (save / "iter_0000006").exists() and (save / "iter_0000004").is_dir()
    straight = pretrain(config("--train-iters", "8"), env={})

    write_tracker(str(save), 4)  # as if the run had died after its non-persistent save of 6
    with LogCapture() as log:
        resumed = pretrain(config(*flags), env={})
    assert any("non-persistent checkpoint of iteration 6" in line for line in log.lines)
    assert resumed.losses == straight.losses[6:]

    write_tracker(str(save), 7)
    again = pretrain(config(*flags), env={})  # the persistent one is newer: from 7
    assert again.losses == straight.losses[7:]

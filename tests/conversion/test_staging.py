"""A conversion's output folder appears only when complete: a new folder is renamed into place, an
existing one receives the entries (the user's other files kept), a failure leaves nothing."""

from __future__ import annotations

import os
import stat

import pytest

from megalite.conversion.staging import staged_folder
from megalite.errors import UserError


def test_a_new_folder_appears_only_on_success(tmp_path):
    target = tmp_path / "a" / "b" / "out"
    with staged_folder(str(target)) as work:
        assert not target.exists()  # not visible before it is complete
        with open(os.path.join(work, "w.bin"), "wb") as f:
            f.write(b"1")
    assert sorted(os.listdir(target)) == ["w.bin"]
    assert os.listdir(target.parent) == ["out"]  # no partial sibling left
    mode = stat.S_IMODE(os.stat(target).st_mode)
    umask = os.umask(0)
    os.umask(umask)
    assert mode == 0o777 & ~umask  # a plain folder, as os.makedirs makes it


def test_a_failure_removes_what_it_created(tmp_path):
    target = tmp_path / "a" / "b" / "out"
    with pytest.raises(RuntimeError), staged_folder(str(target)) as work:
        with open(os.path.join(work, "w.bin"), "wb") as f:
            f.write(b"1")
        raise RuntimeError("the conversion failed")
    assert os.listdir(tmp_path) == []  # the parents it made are gone too


def test_an_existing_folder_is_kept_on_failure_and_updated_on_success(tmp_path):
    target = tmp_path / "out"
    (target / "release").mkdir(parents=True)
    (target / "release" / "old.pt").write_text("old")
    (target / "notes.txt").write_text("mine")
    with pytest.raises(RuntimeError), staged_folder(str(target)) as work:
        os.mkdir(os.path.join(work, "release"))
        raise RuntimeError("the conversion failed")
    assert sorted(os.listdir(target)) == ["notes.txt", "release"]
    assert os.listdir(target / "release") == ["old.pt"]
    with staged_folder(str(target), last=("tracker.txt",)) as work:
        os.mkdir(os.path.join(work, "release"))
        with open(os.path.join(work, "release", "new.pt"), "w") as f:
            f.write("new")
        with open(os.path.join(work, "tracker.txt"), "w") as f:
            f.write("release")
    assert sorted(os.listdir(target)) == ["notes.txt", "release", "tracker.txt"]
    assert os.listdir(target / "release") == ["new.pt"]  # the same-named folder replaced
    assert os.listdir(tmp_path) == ["out"]


def test_an_impossible_folder_is_one_line_before_any_work(tmp_path):
    blocker = tmp_path / "f"
    blocker.write_text("x")
    for target, needle in (
        (blocker / "out", "cannot create the folder (a part of the path is a file"),
        (blocker, "is a file, not a folder"),
    ):
        with pytest.raises(UserError) as e, staged_folder(str(target), flag="--save") as _:
            pytest.fail("entered")
        assert str(e.value).startswith(f"--save {target}: {needle}"), str(e.value)
    assert os.listdir(tmp_path) == ["f"]

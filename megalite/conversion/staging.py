"""Write a conversion's output folder so that a failure leaves nothing that looks like output.

    with staged_folder(save_dir, flag="--save", what="HuggingFace model") as work:
        ...write every file into work...

``work`` is a new hidden sibling of ``save_dir`` (``.<name>.partial-<id>``), created at once, so an
impossible or unwritable ``--save`` is refused before any work (``UserError`` naming the flag).
On success ``work`` becomes ``save_dir``: renamed into place when ``save_dir`` does not exist, or
its entries moved into the folder the user already had (a same-named entry replaced, the ``last``
names moved last: the file that makes the folder loadable). On any failure ``work`` is removed, with
the parent folders it had to create; a folder the user already had is never removed or changed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator, Sequence

from megalite.errors import UserError, check_writable_dir, path_problem


def _missing_folders(folder: str) -> list[str]:
    """The folders ``os.makedirs(folder)`` would create, outermost first."""
    missing = []
    while not os.path.exists(folder):
        missing.append(folder)
        parent = os.path.dirname(folder)
        if parent == folder:
            break
        folder = parent
    return missing[::-1]


def _remove_created(folders: list[str]) -> None:
    for folder in reversed(folders):  # innermost first; stop at one that is not empty
        try:
            os.rmdir(folder)
        except OSError:
            return


def _move_into(work: str, target: str, last: Sequence[str]) -> None:
    """Move ``work``'s entries into the existing ``target`` (same filesystem: renames)."""
    names = sorted(os.listdir(work), key=lambda n: (n in last, last.index(n) if n in last else 0))
    for name in names:
        src, dst = os.path.join(work, name), os.path.join(target, name)
        if os.path.isdir(dst) and not os.path.islink(dst):
            old = os.path.join(work, f".replaced-{uuid.uuid4().hex[:8]}")
            os.rename(dst, old)  # a folder cannot be renamed over a non-empty one
            os.rename(src, dst)
            shutil.rmtree(old)
        else:
            os.replace(src, dst)
    os.rmdir(work)


@contextlib.contextmanager
def staged_folder(
    target: str, *, flag: str = "--save", what: str = "output", last: Sequence[str] = ()
) -> Iterator[str]:
    """Yield a fresh folder to write ``target``'s contents into; see the module docstring."""
    target_abs = os.path.abspath(target)
    if os.path.exists(target_abs) and not os.path.isdir(target_abs):
        raise UserError(f"{flag} {target}: is a file, not a folder; give a folder for the {what}")
    if os.path.isdir(target_abs):
        check_writable_dir(target_abs, flag=flag, what=what)  # its entries get replaced at the end
    parent = os.path.dirname(target_abs)
    created = _missing_folders(parent)
    work = os.path.join(parent, f".{os.path.basename(target_abs)}.partial-{uuid.uuid4().hex[:8]}")
    try:
        os.makedirs(parent, exist_ok=True)
        os.mkdir(work)
    except OSError as e:
        _remove_created(created)
        existing = os.path.dirname(created[0]) if created else parent
        reason = (
            "a part of the path is a file, not a folder"
            if isinstance(e, FileExistsError)
            else path_problem(e)
        )
        raise UserError(
            f"{flag} {target}: cannot create the folder ({reason} at {existing}); give a "
            f"writable folder for the {what}"
        ) from None
    try:
        yield work
        if os.path.isdir(target_abs):
            _move_into(work, target_abs, list(last))
        else:
            os.rename(work, target_abs)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        _remove_created(created)
        raise

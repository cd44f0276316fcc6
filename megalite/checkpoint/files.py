"""Checkpoint files on disk: Megatron's directory layout, crash-safe writes, the tracker file.

    SAVE/latest_checkpointed_iteration.txt               the last complete iteration, or "release"
    SAVE/iter_0000500/mp_rank_{tp:02d}/model_optim_rng.pt           (PP = 1)
    SAVE/iter_0000500/mp_rank_{tp:02d}_{pp:03d}/model_optim_rng.pt  (PP > 1)
    SAVE/iter_0000500/mp_rank_.../distrib_optim_{dp:03d}.pt         (ZeRO-1: one per DP rank)
    SAVE/release/...                                     (converted: no optimizer, no RNG state)

Crash safety: every file is written to ``NAME.tmp``, flushed, fsynced and renamed over ``NAME``; the
tracker is replaced the same way (then its directory is fsynced) and only after every rank has
written and fsynced its files. A crash at any moment leaves the tracker naming the previous
complete checkpoint, whatever half-written ``iter_*`` directory lies beside it.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import zipfile

import torch

from megalite.errors import UserError, path_problem

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1  # header["megalite_checkpoint"] of every model_optim_rng.pt
TRACKER_FILE = "latest_checkpointed_iteration.txt"
MODEL_FILE = "model_optim_rng.pt"
RELEASE = "release"
_ITER_DIR = re.compile(r"^iter_(\d{7,})$")


class CheckpointError(UserError, RuntimeError):
    """A checkpoint cannot be saved or loaded; the message is one line naming the file or flag."""


def iteration_dir(save_dir: str, iteration: int | str) -> str:
    """``SAVE/iter_0000500`` (or ``SAVE/release``)."""
    name = RELEASE if iteration == RELEASE else f"iter_{int(iteration):07d}"
    return os.path.join(save_dir, name)


def shard_dir(iter_dir: str, *, tp_rank: int, pp_rank: int, pp_size: int) -> str:
    """``mp_rank_{tp:02d}`` when PP = 1, else ``mp_rank_{tp:02d}_{pp:03d}`` (Megatron's names)."""
    name = f"mp_rank_{tp_rank:02d}" if pp_size == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    return os.path.join(iter_dir, name)


def distrib_optim_file(dp_rank: int) -> str:
    """The ZeRO-1 state of one DP rank's range, beside ``model_optim_rng.pt``."""
    return f"distrib_optim_{dp_rank:03d}.pt"


def dp_rank_optim_file(dp_rank: int) -> str:
    """The optimizer state that differs between DP ranks (the compressed optimizers' error
    feedback) of one DP rank, beside ``model_optim_rng.pt``."""
    return f"dp_rank_optim_{dp_rank:03d}.pt"


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def tensor_bytes(obj: object) -> int:
    """The bytes of every tensor in ``obj`` (nested dicts, lists, tuples): about what
    ``torch.save`` writes."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def os_error_of(e: BaseException) -> OSError | None:
    """``e`` or the first OSError it was raised from or during (torch's zip writer reports a
    failed write as ``RuntimeError: ... unexpected pos`` raised while handling the OSError)."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def free_bytes(path: str) -> int | None:
    """Free bytes on the file system of ``path`` (or of its nearest existing parent)."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def write_failure(path: str, e: OSError, *, needed: int | None = None) -> CheckpointError:
    """The one-line error for a failed write of ``path``: the reason, and with ``needed`` the
    bytes it needed against the bytes free."""
    text = f"cannot write {path} ({path_problem(e)})"
    free = free_bytes(path)
    if needed is not None and free is not None:
        text += f": it needs about {needed / 1e6:.1f} MB, {free / 1e6:.1f} MB are free there"
    return CheckpointError(text)


def save_file(obj: object, path: str) -> int:
    """``torch.save`` to ``path.tmp``, fsync, rename over ``path``; returns the bytes written.
    A failed write (a full disk, a read-only folder) removes ``path.tmp`` and raises a
    ``CheckpointError`` naming the file, the bytes needed and the bytes free.

    The caller fsyncs the directory once all of its files are renamed."""
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
            size = f.tell()
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:
        cause = os_error_of(e)
        if cause is None:
            raise
        remove_quietly(tmp)
        raise write_failure(path, cause, needed=tensor_bytes(obj)) from None
    return size


def remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def load_file(path: str, *, hint: str = "") -> dict:
    """``torch.load`` (memory-mapped, weights only, on CPU) with a one-line error for a missing,
    truncated or corrupt file."""
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file {path} does not exist{hint}")
    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except (RuntimeError, EOFError, OSError, ValueError, zipfile.BadZipFile) as e:
        text = str(e).strip()
        first = text.splitlines()[0].split(". ")[0] if text else type(e).__name__
        raise CheckpointError(
            f"checkpoint file {path} ({os.path.getsize(path)} bytes) is truncated or corrupt "
            f"({first[:160]}); load another iteration (--ckpt-step N) or save it again"
        ) from None


def read_tracker(save_dir: str) -> int | str | None:
    """The iteration ``SAVE/latest_checkpointed_iteration.txt`` names (int or "release"); None
    when there is no tracker file."""
    path = os.path.join(save_dir, TRACKER_FILE)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        text = f.read().strip()
    if text == RELEASE:
        return RELEASE
    try:
        value = int(text)
    except ValueError:
        raise CheckpointError(
            f"{path} holds {text[:40]!r}, not an iteration number or 'release'; fix or delete it"
        ) from None
    if value < 0:
        raise CheckpointError(f"{path} holds the negative iteration {value}; fix or delete it")
    return value


def write_tracker(save_dir: str, iteration: int | str) -> None:
    """Atomically replace the tracker file: write a temp file, fsync, rename, fsync the folder."""
    path = os.path.join(save_dir, TRACKER_FILE)
    tmp = path + ".tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(f"{iteration}\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        remove_quietly(tmp)
        raise write_failure(path, e) from None
    fsync_dir(save_dir)


def saved_iterations(save_dir: str) -> list[int]:
    """The ``iter_*`` directories present, sorted (complete or not)."""
    if not os.path.isdir(save_dir):
        return []
    found = []
    for name in os.listdir(save_dir):
        m = _ITER_DIR.match(name)
        if m and os.path.isdir(os.path.join(save_dir, name)):
            found.append(int(m.group(1)))
    return sorted(found)


def remove_old_checkpoints(save_dir: str, *, keep: int, latest: int) -> list[int]:
    """``--keep-last-n-checkpoints``: delete the ``iter_*`` directories older than ``latest`` except
    the newest ``keep - 1`` of them (``latest`` itself is always kept). Returns the deleted ones."""
    older = [i for i in saved_iterations(save_dir) if i < latest]
    doomed = older[: max(0, len(older) - (keep - 1))]
    for it in doomed:
        shutil.rmtree(iteration_dir(save_dir, it), ignore_errors=True)
    if doomed:
        logger.info("removed checkpoint(s) %s (--keep-last-n-checkpoints %d)", doomed, keep)
    return doomed

"""Asynchronous saves (``--async-save``): the synchronous files, written while training goes on.

    writer = AsyncCheckpointWriter()
    writer.start(prepare_save(save_dir, it, ...), device=device)   # every rank, at the save
    ...training steps...
    writer.finish()   # every rank, at the next save, on an exit signal and at the end

``start`` copies this rank's part of the checkpoint (``saving.prepare_save``: every collective but
the commit is done) into host memory — pinned on CUDA, plain CPU clones on CPU, so the optimizer
may change the live tensors at once — and hands the copy to a background thread that writes the
files ``saving.write_pending`` writes: temporary names, fsync, rename. The thread issues no
collective. ``finish`` waits for the thread and runs ``saving.commit_checkpoint`` (collective over
the world): only when every rank's files are complete does rank 0 replace the tracker, so a crash
while the thread writes leaves the previous checkpoint the latest. A write that failed on any rank
raises the same CheckpointError on every rank as a synchronous save, at ``finish``.

Host memory: one snapshot at most is in flight (a second ``start`` needs ``finish`` first), its
size is logged in one line, and its storages are kept for the next save, which overwrites those
whose source storage is the same (most of them: parameters, optimizer state) instead of
allocating (and pinning) anew. The copy keeps the storages' sharing (tied weights, views of one
flat buffer), so ``torch.save`` writes the bytes of a synchronous save on CPU.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from megalite.checkpoint.files import CheckpointError
from megalite.checkpoint.saving import PendingSave, finish_save, write_pending

logger = logging.getLogger(__name__)


def host_copy(
    obj: object, *, pin: bool, buffers: dict[tuple, torch.UntypedStorage] | None = None
) -> tuple[object, int]:
    """``obj`` (nested dicts, lists, tuples; other leaves kept as they are, being immutable
    records) with every tensor copied to host memory, pinned when ``pin``; returns (copy, bytes
    copied). Each storage is copied once and every tensor keeps its offset, size and stride in
    it, and an object met twice is copied once, as ``torch.save`` records them. With ``pin`` the
    device copies are asynchronous: call ``torch.cuda.synchronize()`` before reading the copy.

    ``buffers``: the host storages of the previous copy, by source storage (device, address,
    bytes); those whose source is met again are overwritten instead of allocated (no new pages
    to fault in, no new pinned memory), and on return it holds this copy's storages only."""
    old = {} if buffers is None else dict(buffers)
    storages: dict[tuple, torch.UntypedStorage] = {}
    copied = 0

    def storage_copy(t: torch.Tensor) -> torch.UntypedStorage:
        nonlocal copied
        source = t.untyped_storage()
        key = (source.device, source.data_ptr(), source.nbytes())
        if source.nbytes() == 0 or key not in storages:
            n = source.nbytes()
            target = old.pop(key, None)
            if target is None:
                target = torch.empty(n, dtype=torch.uint8, pin_memory=pin).untyped_storage()
            target.copy_(source, non_blocking=pin)
            copied += n
            if n == 0:
                return target
            storages[key] = target
        return storages[key]

    copies: dict[int, object] = {}  # id -> copy: an object met twice is copied once

    def copy(x):
        if id(x) not in copies:
            copies[id(x)] = copy_new(x)
        return copies[id(x)]

    def copy_new(x):
        if isinstance(x, torch.Tensor):
            out = torch.empty(0, dtype=x.dtype).set_(
                storage_copy(x), x.storage_offset(), x.size(), x.stride()
            )
            if isinstance(x, torch.nn.Parameter):
                return torch.nn.Parameter(out, requires_grad=x.requires_grad)
            return out
        if isinstance(x, dict):  # a state dict's OrderedDict keeps its attributes (_metadata)
            out = type(x)((k, copy(v)) for k, v in x.items())
            if type(x) is not dict:
                vars(out).update({k: copy(v) for k, v in vars(x).items()})
            return out
        if isinstance(x, list):
            return [copy(v) for v in x]
        if isinstance(x, tuple):
            return tuple(copy(v) for v in x)
        return x

    out = copy(obj)
    if buffers is not None:
        buffers.clear()
        buffers.update(storages)
    return out, copied


class AsyncCheckpointWriter:
    """One rank's background checkpoint writer; see the module docstring for the contract."""

    def __init__(self) -> None:
        self._pending: PendingSave | None = None
        self._thread: threading.Thread | None = None
        self._result: tuple[int, CheckpointError | None] = (0, None)
        # the host storages of the last snapshot, reused by the next (written by then)
        self._buffers: dict[tuple, torch.UntypedStorage] = {}

    @property
    def in_flight(self) -> int | None:
        """The iteration being written (not yet committed), or None."""
        return None if self._pending is None else self._pending.iteration

    def start(self, pending: PendingSave, *, device: torch.device) -> int:
        """Copy ``pending``'s tensors to host memory (pinned on CUDA) and start writing them in a
        background thread; returns the bytes copied. Training may change the live tensors as
        soon as it returns."""
        if self._pending is not None:
            raise RuntimeError(
                f"the checkpoint of iteration {self._pending.iteration} is still in flight: "
                "call finish() before starting another"
            )
        started = time.perf_counter()
        pin = device.type == "cuda"
        writes, copied = host_copy(pending.writes, pin=pin, buffers=self._buffers)
        if pin:
            torch.cuda.synchronize(device)
        pending.writes = writes
        self._pending, self._result = pending, (0, None)
        self._thread = threading.Thread(
            target=self._write, name=f"checkpoint-writer-{pending.iteration}", daemon=True
        )
        self._thread.start()
        logger.info(
            "async save of iteration %d: %.1f MB copied to %s host memory in %.2f s (one "
            "snapshot in flight at most); training continues while a thread writes it to %s",
            pending.iteration,
            copied / 1e6,
            "pinned" if pin else "CPU",
            time.perf_counter() - started,
            pending.save_dir,
        )
        return copied

    def _write(self) -> None:
        assert self._pending is not None
        try:
            self._result = write_pending(self._pending)
        except Exception as e:  # anything else still fails the save on every rank, at finish
            self._result = (0, CheckpointError(f"the checkpoint writer failed: {e}"))

    def finish(self) -> str | None:
        """Wait for the write in flight, then commit it (collective over the world: every rank
        calls it at the same point); returns its directory, None when nothing was in flight.
        Raises the save's CheckpointError (on every rank) when a write failed on any rank."""
        pending, thread = self._pending, self._thread
        if pending is None or thread is None:
            return None
        thread.join()
        self._pending = self._thread = None
        written, failure = self._result
        return finish_save(pending, written=written, failure=failure)

"""Asynchronous saves (``--async-save``): the synchronous files, written while training goes on.

    writer = AsyncCheckpointWriter()
    writer.start(prepare_save(save_dir, it, ...), device=device)   # every rank, at the save
    ...training steps...
    writer.finish()   # every rank, at the next save, on an exit signal and at the end

``start`` copies this rank's part of the checkpoint (``saving.prepare_save``: every collective but
the commit is done) into host memory — pinned on CUDA, plain CPU memory on CPU, so the optimizer
may change the live tensors at once — and hands the copy to a background thread that writes the
files ``saving.write_pending`` writes: temporary names, fsync, rename. The thread issues no
collective. ``finish`` waits for the thread and runs ``saving.commit_checkpoint`` (collective over
the world): only when every rank's files are complete does rank 0 replace the tracker, so a crash
while the thread writes leaves the previous checkpoint the latest. A write that failed on any rank
raises the same CheckpointError on every rank as a synchronous save, at ``finish``.

Host memory: one snapshot at most is in flight (a second ``start`` needs ``finish`` first), held
in one flat ``HostBuffer`` made at the first save and overwritten by every next one (replaced only
by a larger snapshot): its bytes are logged with each save (``host_buffer.nbytes``), and the stall
of a save is a plain copy into memory that exists, with no allocation, page fault or pinning. The
copy keeps the storages' sharing (tied weights, views of one flat buffer), so ``torch.save``
writes the bytes of a synchronous save on CPU.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import torch

from megalite.checkpoint.files import CheckpointError
from megalite.checkpoint.saving import PendingSave, finish_save, write_pending

logger = logging.getLogger(__name__)


_ALIGN = 64  # bytes: each storage of a snapshot starts on a cache line of the host buffer


class HostBuffer:
    """The host memory of the snapshots: one flat allocation (pinned when ``pin``), kept from
    save to save and replaced only by a larger snapshot, so it is bounded by the largest one and
    a save's copy writes into pages that exist (no allocation, no page faults, no new pinned
    memory). Each storage of a snapshot is its own storage object over a slice of it
    (``torch.frombuffer``), so ``torch.save`` writes it as it writes the live one."""

    def __init__(self, *, pin: bool) -> None:
        self.pin = pin
        self.allocations = 0  # how many times the flat allocation was made (1 in a steady run)
        self._flat = torch.empty(0, dtype=torch.uint8)
        self._view = memoryview(b"")

    @property
    def nbytes(self) -> int:
        """The bytes held (the largest snapshot so far, each storage rounded up to 64)."""
        return self._flat.numel()

    def reserve(self, nbytes: int) -> None:
        """Hold at least ``nbytes``; the earlier allocation goes once no snapshot uses it."""
        if nbytes > self.nbytes:
            self._flat = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)
            self._view = memoryview(self._flat.numpy())
            self.allocations += 1

    def storage(self, offset: int, nbytes: int) -> torch.UntypedStorage:
        """A storage of ``nbytes`` (> 0) over the buffer from ``offset`` (within ``reserve``'s)."""
        view = self._view[offset : offset + nbytes]
        return torch.frombuffer(view, dtype=torch.uint8).untyped_storage()


def _storage_key(t: torch.Tensor) -> tuple:
    s = t.untyped_storage()
    return (s.device, s.data_ptr(), s.nbytes())


def tensors_in(obj: object) -> Iterator[torch.Tensor]:
    """Every tensor in ``obj`` (the containers ``host_copy`` walks), in the order it meets them."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors_in(v)
        if type(obj) is not dict:
            for v in vars(obj).values():
                yield from tensors_in(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors_in(v)


def host_copy(obj: object, *, buffer: HostBuffer) -> tuple[object, int]:
    """``obj`` (nested dicts, lists, tuples; other leaves kept as they are, being immutable
    records) with every tensor copied into ``buffer``'s host memory; returns (copy, bytes
    copied). Each storage is copied once and every tensor keeps its offset, size and stride in
    it, and an object met twice is copied once, as ``torch.save`` records them. With a pinned
    buffer the device copies are asynchronous: call ``torch.cuda.synchronize()`` before reading
    the copy. The copy lives in ``buffer``: the next ``host_copy`` into it overwrites it."""
    places: dict[tuple, tuple[torch.UntypedStorage, int]] = {}  # source -> (itself, offset)
    end = 0
    for t in tensors_in(obj):
        key = _storage_key(t)
        if key not in places and t.untyped_storage().nbytes():
            places[key] = (t.untyped_storage(), end)
            end += -(-t.untyped_storage().nbytes() // _ALIGN) * _ALIGN
    buffer.reserve(end)
    storages: dict[tuple, torch.UntypedStorage] = {}
    copied = 0
    for key, (source, offset) in places.items():
        target = buffer.storage(offset, source.nbytes())
        target.copy_(source, non_blocking=buffer.pin)
        storages[key] = target
        copied += source.nbytes()

    copies: dict[int, object] = {}  # id -> copy: an object met twice is copied once

    def copy(x):
        if id(x) not in copies:
            copies[id(x)] = copy_new(x)
        return copies[id(x)]

    def copy_new(x):
        if isinstance(x, torch.Tensor):
            # an empty storage has no address to share: each its own, as torch.save sees them
            key = _storage_key(x)
            storage = storages[key] if key in storages else torch.UntypedStorage(0)
            out = torch.empty(0, dtype=x.dtype).set_(
                storage, x.storage_offset(), x.size(), x.stride()
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

    return copy(obj), copied


class AsyncCheckpointWriter:
    """One rank's background checkpoint writer; see the module docstring for the contract."""

    def __init__(self) -> None:
        self._pending: PendingSave | None = None
        self._thread: threading.Thread | None = None
        self._result: tuple[int, CheckpointError | None] = (0, None)
        # the host memory of the snapshots, made at the first save and reused by every next
        # one (the last snapshot is written by then)
        self.host_buffer: HostBuffer | None = None

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
        if self.host_buffer is None or self.host_buffer.pin != pin:
            self.host_buffer = HostBuffer(pin=pin)
        writes, copied = host_copy(pending.writes, buffer=self.host_buffer)
        if pin:
            torch.cuda.synchronize(device)
        pending.writes = writes
        self._pending, self._result = pending, (0, None)
        self._thread = threading.Thread(
            target=self._write, name=f"checkpoint-writer-{pending.iteration}", daemon=True
        )
        self._thread.start()
        logger.info(
            "async save of iteration %d: %.1f MB copied in %.2f s into the %.1f MB %s host "
            "buffer (kept for the next save; one snapshot in flight at most); training "
            "continues while a thread writes it to %s",
            pending.iteration,
            copied / 1e6,
            time.perf_counter() - started,
            self.host_buffer.nbytes / 1e6,
            "pinned" if pin else "CPU",
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

"""Asynchronous saves (``--async-save``): the synchronous files, written while training goes on.

    writer = AsyncCheckpointWriter()
    writer.start(prepare_save(save_dir, it, ..., defer_finite_check=True), device=device)
    ...the next step's forward and backward...
    writer.wait_for_copy()   # before the optimizer step changes the saved state
    ...optimizer step, more training steps...
    writer.finish()   # every rank, at the next save, on an exit signal and at the end

``start`` records this rank's part of the checkpoint (``saving.prepare_save``: every collective
but the commit is done; the small state, the scheduler, the loss scaler's scale, the counters and
the RNG states, is captured there, synchronously) and hands it to a background thread, which
copies its tensors into host memory (pinned on CUDA, through a side CUDA stream that waits for
the step's update; plain CPU memory on CPU), checks the live parameters for NaN/inf (the check
of a synchronous save), then writes the files ``saving.write_pending`` writes: temporary names,
fsync, rename. The copy runs beside the next step's forward and backward, which change neither
parameters nor optimizer state; the optimizer step calls ``wait_for_copy`` first. Every call of
the copy and the check releases the GIL, which the step's Python needs between its ops; on CPU
they are numpy's, which run on the writer thread alone (torch's would start a second team of
intra-op threads beside the step's), and the thread runs at nice 19 (``nice``). ZeRO-3
releases the whole parameters when the save returns: there ``start`` waits for the copy itself
(``wait_for_copy=True``). The thread issues no collective. ``finish`` waits for the thread and
runs ``saving.finish_save`` (collective over the world): only when every rank's files are
complete does rank 0 replace the tracker, so a crash while the thread writes leaves the previous
checkpoint the latest. A write that failed on any rank raises the same CheckpointError on every
rank as a synchronous save, at ``finish``; so does a NaN/inf parameter on any rank (the rank that
found it wrote nothing; rank 0 removes the others' files of that iteration).

Host memory: one snapshot at most is in flight (a second ``start`` needs ``finish`` first), held
in one flat ``HostBuffer`` made at the first save and overwritten by every next one (replaced only
by a larger snapshot): its bytes are logged with each save (``host_buffer.nbytes``), and a save's
copy is a plain copy into memory that exists, with no allocation, page fault or pinning. The
copy keeps the storages' sharing (tied weights, views of one flat buffer), so ``torch.save``
writes the bytes of a synchronous save on CPU.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Iterator

import numpy as np
import torch

from megalite.checkpoint.files import CheckpointError
from megalite.checkpoint.saving import (
    PendingSave,
    finish_save,
    non_finite_beside_training,
    numpy_view,
    write_pending,
)

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


@dataclasses.dataclass
class HostSnapshot:
    """A planned host copy (``plan_host_copy``): ``obj`` with every tensor over the host buffer,
    whose bytes are there once ``copy`` ran; ``pairs``: (live storage, its host storage)."""

    obj: object
    pairs: list[tuple[torch.UntypedStorage, torch.UntypedStorage]]
    nbytes: int  # the bytes ``copy`` copies

    def copy(self, *, non_blocking: bool) -> None:
        """Copy every live storage into its host one (``non_blocking``: device -> pinned copies
        are asynchronous on the current stream: synchronise it before reading the copy). Each
        copy releases the GIL, which the training step's Python needs while a writer thread
        copies beside it (``UntypedStorage.copy_`` holds it for the whole copy); a CPU copy is
        numpy's, on the calling thread alone (torch's would start its own team of intra-op
        threads beside the step's)."""
        for source, target in self.pairs:
            if source.device.type == "cpu":
                np.copyto(numpy_view(_bytes(target)), numpy_view(_bytes(source)))
            else:
                _bytes(target).copy_(_bytes(source), non_blocking=non_blocking)


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """The bytes of ``storage`` as a tensor ([nbytes] uint8, on its device)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def plan_host_copy(obj: object, *, buffer: HostBuffer) -> HostSnapshot:
    """The host copy of ``obj`` (nested dicts, lists, tuples; other leaves kept as they are,
    being immutable records) laid out in ``buffer``, its bytes not yet copied: the containers are
    copied now (so the live ones may change), the tensors' bytes by ``HostSnapshot.copy``. Each
    storage is copied once and every tensor keeps its offset, size and stride in it, and an
    object met twice is copied once, as ``torch.save`` records them. The copy lives in
    ``buffer``: the next copy into it overwrites it."""
    places: dict[tuple, tuple[torch.UntypedStorage, int]] = {}  # source -> (itself, offset)
    end = 0
    for t in tensors_in(obj):
        key = _storage_key(t)
        if key not in places and t.untyped_storage().nbytes():
            places[key] = (t.untyped_storage(), end)
            end += -(-t.untyped_storage().nbytes() // _ALIGN) * _ALIGN
    buffer.reserve(end)
    storages: dict[tuple, torch.UntypedStorage] = {}
    pairs = []
    for key, (source, offset) in places.items():
        storages[key] = buffer.storage(offset, source.nbytes())
        pairs.append((source, storages[key]))

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

    return HostSnapshot(copy(obj), pairs, sum(source.nbytes() for source, _ in pairs))


def host_copy(obj: object, *, buffer: HostBuffer) -> tuple[object, int]:
    """``plan_host_copy`` and its copy at once; returns (copy, bytes copied). With a pinned
    buffer the device copies are asynchronous: call ``torch.cuda.synchronize()`` before reading
    the copy."""
    snapshot = plan_host_copy(obj, buffer=buffer)
    snapshot.copy(non_blocking=buffer.pin)
    return snapshot.obj, snapshot.nbytes


WRITER_NICE = 19  # the lowest CPU priority: the writer takes the cycles the step leaves


def set_thread_nice(nice: int) -> None:
    """Give the calling thread the CPU priority ``nice`` (Linux: the nice value is per thread).
    The step's intra-op threads fill the cores and wait for each other at the end of every
    parallel op: a writer thread taking one of their cores at the same priority makes the whole
    team wait, a writer at nice 19 runs where they leave a core idle (and, on a machine other
    processes load, after them). Where a thread's priority cannot be set, it stays the step's."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except OSError:
        pass


class AsyncCheckpointWriter:
    """One rank's background checkpoint writer; see the module docstring for the contract."""

    def __init__(self, *, nice: int = WRITER_NICE) -> None:
        self.nice = nice  # the writer thread's CPU priority (``set_thread_nice``)
        self._pending: PendingSave | None = None
        self._thread: threading.Thread | None = None
        self._result: tuple[int, CheckpointError | None] = (0, None)
        self._non_finite: list[str] = []  # the parameters the copy found NaN/inf on this rank
        self._copied = threading.Event()  # set: no copy in flight, the live state may change
        self._copied.set()
        self._stream = None  # CUDA: the side stream of the copies, made at the first save
        # the host memory of the snapshots, made at the first save and reused by every next
        # one (the last snapshot is written by then)
        self.host_buffer: HostBuffer | None = None
        self.copy_wait_seconds = 0.0  # how long ``wait_for_copy`` blocked, all saves together

    @property
    def in_flight(self) -> int | None:
        """The iteration being written (not yet committed), or None."""
        return None if self._pending is None else self._pending.iteration

    @property
    def copying(self) -> bool:
        """A copy is in flight: the live state must not change yet (``wait_for_copy``)."""
        return not self._copied.is_set()

    @property
    def writing(self) -> bool:
        """The background thread still copies or writes (``finish`` would wait for it)."""
        return self._thread is not None and self._thread.is_alive()

    def start(
        self, pending: PendingSave, *, device: torch.device, wait_for_copy: bool = False
    ) -> int:
        """Start copying ``pending``'s tensors to host memory (pinned on CUDA) and writing them,
        in a background thread; returns the bytes it copies. Until ``wait_for_copy`` returns, the
        live tensors must not change: forward and backward may run, the optimizer step may not.
        ``wait_for_copy=True``: the copy is done on return (state that changes before the next
        optimizer step: ZeRO-3's whole parameters, released once the save returns)."""
        if self._pending is not None:
            raise RuntimeError(
                f"the checkpoint of iteration {self._pending.iteration} is still in flight: "
                "call finish() before starting another"
            )
        started = time.perf_counter()
        pin = device.type == "cuda"
        if self.host_buffer is None or self.host_buffer.pin != pin:
            self.host_buffer = HostBuffer(pin=pin)
        snapshot = plan_host_copy(pending.writes, buffer=self.host_buffer)
        pending.writes = snapshot.obj
        ready = None
        if pin:  # the copies start once the work queued so far (the step's update) is done
            if self._stream is None:
                self._stream = torch.cuda.Stream(device=device)
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))
        self._pending, self._result, self._non_finite = pending, (0, None), []
        self._copied = threading.Event()
        self._thread = threading.Thread(
            target=self._run,
            args=(pending, snapshot, ready),
            name=f"checkpoint-writer-{pending.iteration}",
            daemon=True,
        )
        self._thread.start()
        if wait_for_copy:
            self.wait_for_copy()
        logger.info(
            "async save of iteration %d: %.1f MB to copy into the %.1f MB %s host buffer (kept "
            "for the next save; one snapshot in flight at most), %s; the save call took %.2f s; "
            "a thread copies, checks for NaN/inf and writes to %s",
            pending.iteration,
            snapshot.nbytes / 1e6,
            self.host_buffer.nbytes / 1e6,
            "pinned" if pin else "CPU",
            "copied already" if wait_for_copy else "the optimizer step waits for the copy",
            time.perf_counter() - started,
            pending.save_dir,
        )
        return snapshot.nbytes

    def wait_for_copy(self) -> float:
        """Block until the copy in flight and its NaN/inf check are done, so that the live state
        may change: the training loop calls it before the optimizer step. Returns the seconds
        it blocked (0.0 when no copy was in flight)."""
        if self._copied.is_set():
            return 0.0
        started = time.perf_counter()
        self._copied.wait()
        waited = time.perf_counter() - started
        self.copy_wait_seconds += waited
        return waited

    def _run(self, pending: PendingSave, snapshot: HostSnapshot, ready) -> None:
        set_thread_nice(self.nice)
        try:
            try:
                self._non_finite = self._copy_and_check(snapshot, pending.unchecked, ready)
            finally:  # the live tensors (some of them copies made for the save) not held
                pending.unchecked, snapshot.pairs = [], []
                self._copied.set()
            if not self._non_finite:  # else no file: ``finish`` refuses it on every rank
                self._result = write_pending(pending)
        except Exception as e:  # anything else still fails the save on every rank, at finish
            self._result = (0, CheckpointError(f"the checkpoint writer failed: {e}"))

    def _copy_and_check(
        self, snapshot: HostSnapshot, unchecked: list[tuple[str, torch.Tensor]], ready
    ) -> list[str]:
        """The copy and the NaN/inf check of the live parameters (the names found), both while
        the state is unchanged. CUDA (``ready``: the event after the step's update): both on the
        side stream, then a wait for it (the pinned copy is complete on return)."""
        if ready is None:
            snapshot.copy(non_blocking=False)
            return non_finite_beside_training(unchecked)
        stream = self._stream
        with torch.cuda.stream(stream):
            stream.wait_event(ready)
            snapshot.copy(non_blocking=True)
            names = non_finite_beside_training(unchecked)
        stream.synchronize()
        return names

    def finish(self) -> str | None:
        """Wait for the write in flight, then commit it (collective over the world: every rank
        calls it at the same point); returns its directory, None when nothing was in flight.
        Raises the save's CheckpointError (on every rank) when a write failed on any rank, or
        the refusal of a synchronous save when a parameter was NaN/inf on any rank (no file of
        that iteration stays)."""
        pending, thread = self._pending, self._thread
        if pending is None or thread is None:
            return None
        thread.join()
        self._pending = self._thread = None
        written, failure = self._result
        return finish_save(
            pending, written=written, failure=failure, non_finite_names=self._non_finite
        )

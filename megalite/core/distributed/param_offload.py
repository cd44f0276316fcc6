"""Where ZeRO-3's flat parameter shards live: the device, the host, or files (ZeRO-Infinity).

    spec = ParamOffloadSpec(directory=None)              # host memory (pinned on CUDA)
    spec = ParamOffloadSpec(directory="/nvme", host_bytes=64 << 20)   # files, streamed
    store = ParamStore(spec, device=torch.device("cuda"), prefix="rank0_zero3")
    shard = store.create("b0", numel, dtype) # zeros: a host tensor, or a ParamFile
    store.write(shard, lo, values)           # values -> shard[lo : ...]
    store.read_into(shard, lo, out)          # shard[lo : lo + out.numel()] -> out (the device)
    future = store.prefetch(shard, lo, out)  # the same, on the background reader thread
    grads = store.create("b0", numel, torch.float32, suffix="grad")   # ZeRO-3's grad files
    store.add(grads, lo, values)             # grads[lo : ...] += values
    store.remove_files()                     # at the end of a run: the files it created

A ``ParamFile`` holds one flat shard of ``numel`` elements of the param dtype in one file
(``<directory>/<prefix>_<name>.param``; the reduced grad shards ZeRO-3 keeps in files beside
them: ``.grad``). Reads and writes go through host staging buffers of at most
``host_bytes`` in all (a read buffer for the reader thread, a write buffer for the caller: each
half the bound, or the largest shard's bytes if that is less), chunk by chunk, with ``readinto`` /
``write`` (no mmap, so file pages stay in the page cache, not in the process). On CUDA the staging
buffers are pinned and each chunk is copied to or from the device. ZeRO-3 brings the unit it
gathers next from the file on the reader thread while the current unit computes (one unit ahead);
whoever writes waits for reads in flight first (``drain``).
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ParamOffloadSpec:
    """The param shards on the host (``directory`` None) or in files under ``directory``,
    streamed through ``host_bytes`` of host staging buffers."""

    directory: str | None = None
    host_bytes: int = 256 << 20

    @property
    def place(self) -> str:
        return "host" if self.directory is None else "disk"


class ParamFile:
    """One flat param shard in a file (module docstring): ``numel`` elements of ``dtype``; the
    params compute on ``device``."""

    def __init__(self, store: ParamStore, path: str, numel: int, dtype: torch.dtype):
        self.store, self.path, self.numel, self.dtype = store, path, numel, dtype
        self.device = store.device
        with open(path, "wb") as f:
            f.truncate(numel * dtype.itemsize)  # zeros (sparse until written)

    def read(self, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` as a new tensor on the device."""
        return self.store.read(self, lo, hi)

    def write(self, lo: int, values: torch.Tensor) -> None:
        """``values`` (rounded to ``dtype``) -> elements ``[lo, lo + values.numel())``."""
        self.store.write(self, lo, values)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


class ParamStore:
    """The param shards of one ZeRO-3 model (module docstring); ``spec`` None keeps them on
    ``device`` (``adopt`` returns the shard itself)."""

    def __init__(self, spec: ParamOffloadSpec | None, *, device: torch.device, prefix: str):
        self.spec, self.device, self.prefix = spec, device, prefix
        self.place = "device" if spec is None else spec.place
        self.pinned = device.type == "cuda" and spec is not None
        self.files: list[ParamFile] = []  # the param shards' files
        self.grad_files: list[ParamFile] = []  # ZeRO-3's grad shards in files (``suffix="grad"``)
        self.host: list[torch.Tensor] = []
        # files: "read" / "write" staging, each half the bound (or the largest shard, if smaller)
        self._staging: dict[str, torch.Tensor] = {}
        self._reader: ThreadPoolExecutor | None = None
        self._in_flight: list[Future] = []
        self._made_directory = False  # remove_files removes it too (when empty)
        if self.place == "disk":
            self._made_directory = not os.path.isdir(spec.directory)
            os.makedirs(spec.directory, exist_ok=True)
            if not os.access(spec.directory, os.W_OK):
                raise ValueError(f"param offload directory {spec.directory} is not writable")

    def create(
        self, name: str, numel: int, dtype: torch.dtype, *, suffix: str = "param"
    ) -> torch.Tensor | ParamFile:
        """A flat shard of ``numel`` zeros at its home: a device tensor, a host tensor, or a
        ``ParamFile`` (``suffix`` "grad": a grad shard's file, in ``grad_files``)."""
        if self.place == "device":
            return torch.zeros(numel, dtype=dtype, device=self.device)
        if self.place == "host":
            host = torch.zeros(numel, dtype=dtype, pin_memory=self.pinned)
            self.host.append(host)
            return host
        need = min(self.spec.host_bytes // 2, numel * dtype.itemsize)
        for role in ("read", "write"):  # each: half the bound, or the largest shard if smaller
            if role not in self._staging or self._staging[role].numel() < need:
                self._staging[role] = torch.empty(need, dtype=torch.uint8, pin_memory=self.pinned)
        path = os.path.join(self.spec.directory, f"{self.prefix}_{name}.{suffix}")
        file = ParamFile(self, path, numel, dtype)
        (self.grad_files if suffix == "grad" else self.files).append(file)
        return file

    # --- streaming --------------------------------------------------------------------------------

    def _buffer(self, role: str, dtype: torch.dtype) -> torch.Tensor:
        """The ``role`` staging buffer as ``dtype`` elements."""
        buf = self._staging[role]
        if buf.numel() < dtype.itemsize:
            raise ValueError(
                f"param offload host_bytes {self.spec.host_bytes} hold no {dtype} element in "
                "each of its two staging buffers"
            )
        return buf[: buf.numel() // dtype.itemsize * dtype.itemsize].view(dtype)

    def read_into(self, shard: torch.Tensor | ParamFile, lo: int, out: torch.Tensor) -> None:
        """``shard[lo : lo + out.numel()]`` -> ``out`` (blocking; files: on the reader thread too,
        the one user of the read buffer)."""
        if not isinstance(shard, ParamFile):
            out.copy_(shard[lo : lo + out.numel()], non_blocking=self.pinned)
            return
        self.prefetch(shard, lo, out).result()

    def _read_file(self, shard: ParamFile, lo: int, out: torch.Tensor) -> None:
        buf = self._buffer("read", shard.dtype)
        with open(shard.path, "rb") as f:
            for a in range(0, out.numel(), buf.numel()):
                n = min(buf.numel(), out.numel() - a)
                f.seek((lo + a) * shard.dtype.itemsize)
                f.readinto(_bytes(buf[:n]))
                out[a : a + n].copy_(buf[:n])  # waits: the buffer is reused by the next chunk

    def prefetch(self, shard: torch.Tensor | ParamFile, lo: int, out: torch.Tensor) -> Future:
        """``read_into`` on the reader thread (files); at once otherwise."""
        if not isinstance(shard, ParamFile):
            self.read_into(shard, lo, out)
            done: Future = Future()
            done.set_result(None)
            return done
        if self._reader is None:
            self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="param-offload")
        future = self._reader.submit(self._read_file, shard, lo, out)
        self._in_flight = [f for f in self._in_flight if not f.done()] + [future]
        return future

    def drain(self) -> None:
        """Wait for every read in flight (before a write may touch what they read)."""
        for future in self._in_flight:
            future.result()
        self._in_flight = []

    def write(self, shard: torch.Tensor | ParamFile, lo: int, values: torch.Tensor) -> None:
        """``values`` (any device, rounded to the shard's dtype) -> ``shard[lo : ...]``."""
        if not isinstance(shard, ParamFile):  # blocking: the host may read the shard next
            shard[lo : lo + values.numel()].copy_(values)
            return
        self.drain()
        buf = self._buffer("write", shard.dtype)
        values = values.reshape(-1)
        with open(shard.path, "r+b") as f:
            for a in range(0, values.numel(), buf.numel()):
                n = min(buf.numel(), values.numel() - a)
                buf[:n].copy_(values[a : a + n])
                f.seek((lo + a) * shard.dtype.itemsize)
                f.write(_bytes(buf[:n]))

    def add(self, shard: ParamFile, lo: int, values: torch.Tensor) -> None:
        """``shard[lo : lo + values.numel()] += values`` (read, add, write back, chunk by chunk
        through the write buffer; the reader thread's reads of param files go on meanwhile)."""
        buf = self._buffer("write", shard.dtype)
        values = values.reshape(-1)
        with open(shard.path, "r+b") as f:
            for a in range(0, values.numel(), buf.numel()):
                n = min(buf.numel(), values.numel() - a)
                f.seek((lo + a) * shard.dtype.itemsize)
                f.readinto(_bytes(buf[:n]))
                buf[:n].add_(values[a : a + n])
                f.seek((lo + a) * shard.dtype.itemsize)
                f.write(_bytes(buf[:n]))

    def read(self, shard: torch.Tensor | ParamFile, lo: int, hi: int) -> torch.Tensor:
        """``shard[lo:hi]`` as a new tensor on the device."""
        out = torch.empty(hi - lo, dtype=shard.dtype, device=self.device)
        self.read_into(shard, lo, out)
        return out

    # --- accounting -------------------------------------------------------------------------------

    def host_tensors(self) -> list[torch.Tensor]:
        """The host shards, or the two staging buffers."""
        return self.host + list(self._staging.values())

    @property
    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.host_tensors())

    @property
    def disk_bytes(self) -> int:
        """Bytes of the param files (the grad files: ``grad_disk_bytes``)."""
        return sum(os.path.getsize(f.path) for f in self.files)

    @property
    def grad_disk_bytes(self) -> int:
        return sum(os.path.getsize(f.path) for f in self.grad_files)

    def close(self) -> None:
        if self._reader is not None:
            self.drain()
            self._reader.shutdown()
            self._reader = None

    def remove_files(self) -> None:
        """The end of a run: stop the reader, delete the files this store created (and its
        directory, when the store made it and nothing else is left there)."""
        self.close()
        for file in [*self.files, *self.grad_files]:
            if os.path.exists(file.path):
                os.remove(file.path)
        self.files, self.grad_files = [], []
        if self._made_directory and not os.listdir(self.spec.directory):
            os.rmdir(self.spec.directory)


def _bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor (any dtype, bf16 included)."""
    return memoryview(t.view(torch.uint8).numpy()).cast("B")

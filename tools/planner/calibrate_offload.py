"""The offload links of ``tools/plan.py --calibrate``: host <-> device copies and NVMe reads and
writes, as the planner charges offloaded state's transfers (``planning.offload_time``).

    figures = offload_figures(directory, device=torch.device("cuda"))
    # {"host_gbps": ..., "disk_read_gbps": ..., "disk_write_gbps": ...}

- host: on a GPU a pinned host tensor copied to the device and back (GB/s of the round trip's
  bytes), the path of pinned offload buffers; on a CPU a memcpy between two host tensors;
- disk: a temporary file of ``nbytes`` under ``directory`` (the calibration file's folder: put it
  on the drive the offload files will use) written in chunks and ``fsync``-ed, its pages then
  dropped from the page cache (``posix_fadvise`` DONTNEED) and read back with ``readinto``; the
  file is removed. Medians of ``repeat`` runs.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import torch

CHUNK = 8 << 20  # bytes per write / read call, as the offload stores stream their files


def host_copy_gbps(device: torch.device, nbytes: int, *, repeat: int = 5) -> float:
    """GB/s of host <-> device copies (pinned, round trip) on a GPU; of a memcpy on a CPU."""
    n = max(nbytes // 4, 1)
    cuda = device.type == "cuda"
    src = torch.ones(n, pin_memory=cuda)
    dst = torch.empty(n, device=device)
    back = torch.empty(n, pin_memory=cuda)
    times = []
    for _ in range(repeat + 1):  # the first run warms the allocator and the DMA path
        start = time.perf_counter()
        dst.copy_(src, non_blocking=cuda)
        if cuda:
            back.copy_(dst, non_blocking=True)
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    moved = (2 if cuda else 1) * n * 4
    return moved / statistics.median(times[1:]) / 1e9


def disk_gbps(directory: str, nbytes: int, *, repeat: int = 3) -> tuple[float, float]:
    """(read, write) GB/s of a temporary file under ``directory`` (module docstring)."""
    os.makedirs(directory, exist_ok=True)
    block = bytearray(os.urandom(min(CHUNK, nbytes)))
    reads, writes = [], []
    for _ in range(repeat):
        fd, path = tempfile.mkstemp(prefix="megalite-calibrate-", suffix=".bin", dir=directory)
        try:
            with os.fdopen(fd, "wb", buffering=0) as f:
                start = time.perf_counter()
                for offset in range(0, nbytes, len(block)):
                    f.write(memoryview(block)[: min(len(block), nbytes - offset)])
                os.fsync(f.fileno())
                writes.append(time.perf_counter() - start)
                if hasattr(os, "posix_fadvise"):  # read from the drive, not the page cache
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            with open(path, "rb", buffering=0) as f:
                start = time.perf_counter()
                while f.readinto(block):
                    pass
                reads.append(time.perf_counter() - start)
        finally:
            os.remove(path)
    return nbytes / statistics.median(reads) / 1e9, nbytes / statistics.median(writes) / 1e9


def offload_figures(directory: str, *, device: torch.device, nbytes: int | None = None) -> dict:
    """The calibration file's offload figures (module docstring); ``nbytes`` per transfer
    (default 256 MiB on a GPU, 64 MiB on a CPU)."""
    if nbytes is None:
        nbytes = (256 if device.type == "cuda" else 64) << 20
    read, write = disk_gbps(directory, nbytes)
    return {
        "host_gbps": host_copy_gbps(device, nbytes),
        "disk_read_gbps": read,
        "disk_write_gbps": write,
    }

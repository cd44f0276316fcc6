"""Optimizer state in files (NVMe offload), read and written in bounded sub-groups.

    store = NvmeStore(directory, "rank3_b0", numel, host_bytes=256 << 20)
    for lo, hi in store.chunks(a, b):          # sub-groups of at most store.chunk elements
        master, exp_avg, exp_avg_sq, grad = store.load(lo, hi)   # host views [hi - lo]
        ...update in place...
        store.save(lo, hi)

One flat fp32 file per state (``<prefix>.master``, ``.exp_avg``, ``.exp_avg_sq``) of ``numel``
elements; the host holds four fp32 buffers of ``chunk`` elements (the three states and the grad),
allocated once, plus two chunk-sized temporaries of the AdamW update: ``24 chunk <= host_bytes``.
Reads and writes go through ``readinto`` / ``write`` on the buffers' memory (no mmap, so the page
cache, not the process, holds file pages).
"""

from __future__ import annotations

import os

import torch

KEYS = ("master", "exp_avg", "exp_avg_sq")


class NvmeStore:
    def __init__(self, directory: str, prefix: str, numel: int, *, host_bytes: int):
        self.numel = numel
        self.chunk = max(1, min(numel, host_bytes // 24))  # 4 buffers + 2 temporaries, fp32
        if host_bytes < 24:
            raise ValueError(f"the NVMe host buffer bound {host_bytes} B holds no element")
        os.makedirs(directory, exist_ok=True)
        self.paths = {k: os.path.join(directory, f"{prefix}.{k}") for k in KEYS}
        for path in self.paths.values():
            with open(path, "wb") as f:
                f.truncate(numel * 4)  # zeros (sparse until written)
        self.buffers = {k: torch.zeros(self.chunk, dtype=torch.float32) for k in (*KEYS, "grad")}

    @property
    def disk_bytes(self) -> int:
        return 3 * self.numel * 4

    @property
    def host_bytes(self) -> int:
        return sum(b.numel() * 4 for b in self.buffers.values())

    def chunks(self, lo: int, hi: int):
        """``[a, b)`` sub-ranges of ``[lo, hi)`` of at most ``chunk`` elements."""
        for a in range(lo, hi, self.chunk):
            yield a, min(a + self.chunk, hi)

    def load(self, lo: int, hi: int, keys=KEYS) -> list[torch.Tensor]:
        """Elements ``[lo, hi)`` of ``keys`` into the host buffers; returns their views (and the
        grad buffer's last)."""
        out = []
        for k in keys:
            view = self.buffers[k][: hi - lo]
            with open(self.paths[k], "rb") as f:
                f.seek(lo * 4)
                f.readinto(memoryview(view.numpy()).cast("B"))
            out.append(view)
        return [*out, self.buffers["grad"][: hi - lo]]

    def save(self, lo: int, hi: int, keys=KEYS) -> None:
        """The host buffers' first ``hi - lo`` elements of ``keys`` -> the files at ``lo``."""
        for k in keys:
            with open(self.paths[k], "r+b") as f:
                f.seek(lo * 4)
                f.write(memoryview(self.buffers[k][: hi - lo].numpy()).cast("B"))

    def read(self, key: str) -> torch.Tensor:
        """The whole file of ``key`` (checkpoints only: ``numel`` fp32 on the host)."""
        out = torch.empty(self.numel, dtype=torch.float32)
        with open(self.paths[key], "rb") as f:
            f.readinto(memoryview(out.numpy()).cast("B"))
        return out

    def write(self, key: str, values: torch.Tensor) -> None:
        with open(self.paths[key], "r+b") as f:
            f.write(memoryview(values.detach().float().cpu().contiguous().numpy()).cast("B"))

"""Optimizer state in files (NVMe offload), read and written in bounded sub-groups.

    store = NvmeStore(directory, "rank3_b0", numel, host_bytes=256 << 20)
    for lo, hi in store.chunks(a, b):          # sub-groups of at most store.chunk elements
        master, exp_avg, exp_avg_sq, grad = store.load(lo, hi)   # host views [hi - lo]
        ...update in place...
        store.save(lo, hi)
    for lo, hi, inside in chunk_spans(spans, store.chunk): ...   # chunks that span pieces
    store.remove_files()                       # at the end of a run

One flat fp32 file per state (``<prefix>.master``, ``.exp_avg``, ``.exp_avg_sq``) of ``numel``
elements (``existing``: a key's file that already holds it, e.g. fp32 ZeRO-3 params offloaded to a
file are their own masters); the host holds four fp32 buffers of ``chunk`` elements (the three
states and the grad), allocated once, plus two chunk-sized temporaries of the AdamW update:
``24 chunk <= host_bytes``. Reads and writes go through ``readinto`` / ``write`` on the buffers'
memory (no mmap, so the page cache, not the process, holds file pages).

On CUDA (``device``) the four buffers are pinned, so their device copies are DMA transfers that
return at once (``non_blocking``); the store fences the current stream before the host touches a
buffer a queued copy may still use: before overwriting the master buffer (the caller rounds it into
the params with a non-blocking copy), before the host reads the grad it staged, and before writing
a staged buffer to disk. ``load(..., grads=[(offset, device_slice), ...])`` stages the grads while
the moments are read from the files. On CPU nothing is pinned and nothing waits (and the caller
need not stage host grads at all).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
from typing import NamedTuple

import torch

KEYS = ("master", "exp_avg", "exp_avg_sq")


class NvmeStore:
    def __init__(
        self,
        directory: str,
        prefix: str,
        numel: int,
        *,
        host_bytes: int,
        device: torch.device | str | None = None,
        existing: dict[str, str] | None = None,
    ):
        self.numel = numel
        self.device = torch.device(device if device is not None else "cpu")
        self.pinned = self.device.type == "cuda"  # host <-> device copies are DMA, non-blocking
        self.chunk = max(1, min(numel, host_bytes // 24))  # 4 buffers + 2 temporaries, fp32
        if host_bytes < 24:
            raise ValueError(f"the NVMe host buffer bound {host_bytes} B holds no element")
        self.directory = directory
        self._made_directory = not os.path.isdir(directory)  # remove_files removes it too
        os.makedirs(directory, exist_ok=True)
        self.paths = {k: os.path.join(directory, f"{prefix}.{k}") for k in KEYS}
        for key, path in self.paths.items():
            if key not in (existing or {}):
                with open(path, "wb") as f:
                    f.truncate(numel * 4)  # zeros (sparse until written)
        self.own_paths = [p for k, p in self.paths.items() if k not in (existing or {})]
        self.paths.update(existing or {})
        self.buffers = {k: self._buffer() for k in (*KEYS, "grad")}
        self._staged = False  # a non-blocking copy into a buffer may still be in flight

    def _buffer(self) -> torch.Tensor:
        buf = torch.zeros(self.chunk, dtype=torch.float32)
        return buf.pin_memory() if self.pinned else buf

    def _fence(self) -> None:
        """Wait for the copies queued on the device's current stream (pinned buffers only)."""
        if self.pinned:
            torch.cuda.current_stream(self.device).synchronize()
        self._staged = False

    @property
    def disk_bytes(self) -> int:
        """Bytes of the state files (those adopted through ``existing`` included)."""
        return 3 * self.numel * 4

    @property
    def host_bytes(self) -> int:
        return sum(b.numel() * 4 for b in self.buffers.values())

    def chunks(self, lo: int, hi: int):
        """``[a, b)`` sub-ranges of ``[lo, hi)`` of at most ``chunk`` elements."""
        for a in range(lo, hi, self.chunk):
            yield a, min(a + self.chunk, hi)

    def load(
        self, lo: int, hi: int, keys=KEYS, grads: Iterable[tuple[int, torch.Tensor]] = ()
    ) -> list:
        """Elements ``[lo, hi)`` of ``keys`` into the host buffers; returns their views (and the
        grad buffer's last). ``grads``: ``(offset, values)`` parts (on the device) copied into
        the grad buffer at ``offset`` from ``lo``, in flight while the files are read."""
        n = hi - lo
        for offset, values in grads:
            self.buffers["grad"][offset : offset + values.numel()].copy_(
                values, non_blocking=self.pinned
            )
            self._staged = True
        # the master buffer last: a non-blocking copy of the previous chunk's masters into the
        # params may still read it (that fence also lands the grad above)
        for k in sorted(keys, key=lambda k: k == "master"):
            if k == "master":
                self._fence()
            self._read(k, lo, self.buffers[k][:n])
        if self._staged:
            self._fence()
        return [*(self.buffers[k][:n] for k in keys), self.buffers["grad"][:n]]

    def stage(self, key: str, values: torch.Tensor) -> torch.Tensor:
        """``values`` (any device) into the first elements of buffer ``key`` without waiting;
        ``save`` fences before writing them. Returns the buffer's view."""
        self._fence()  # the buffer may still be read by a queued copy
        view = self.buffers[key][: values.numel()]
        view.copy_(values, non_blocking=self.pinned)
        self._staged = True
        return view

    def save(self, lo: int, hi: int, keys=KEYS) -> None:
        """The host buffers' first ``hi - lo`` elements of ``keys`` -> the files at ``lo``."""
        if self._staged:
            self._fence()
        for k in keys:
            self._write(k, lo, self.buffers[k][: hi - lo])

    def _read(self, key: str, lo: int, view: torch.Tensor) -> None:
        with open(self.paths[key], "rb") as f:
            f.seek(lo * 4)
            f.readinto(memoryview(view.numpy()).cast("B"))

    def _write(self, key: str, lo: int, view: torch.Tensor) -> None:
        with open(self.paths[key], "r+b") as f:
            f.seek(lo * 4)
            f.write(memoryview(view.numpy()).cast("B"))

    def read(self, key: str) -> torch.Tensor:
        """The whole file of ``key`` (checkpoints only: ``numel`` fp32 on the host)."""
        out = torch.empty(self.numel, dtype=torch.float32)
        with open(self.paths[key], "rb") as f:
            f.readinto(memoryview(out.numpy()).cast("B"))
        return out

    def write(self, key: str, values: torch.Tensor) -> None:
        with open(self.paths[key], "r+b") as f:
            f.write(memoryview(values.detach().float().cpu().contiguous().numpy()).cast("B"))

    def remove_files(self) -> None:
        """The end of a run: delete the files this store created (not those ``existing`` named),
        and its directory when the store made it and nothing else is left there."""
        for path in self.own_paths:
            if os.path.exists(path):
                os.remove(path)
        self.own_paths = []
        if self._made_directory and os.path.isdir(self.directory):
            if not os.listdir(self.directory):
                os.rmdir(self.directory)


class Span(NamedTuple):
    """Elements ``[start, start + numel)`` of a flat state (one parameter's piece of a shard)."""

    start: int
    numel: int


def chunk_spans(spans: Sequence, chunk: int) -> Iterator[tuple[int, int, list]]:
    """``(lo, hi, inside)`` for consecutive ranges of at most ``chunk`` elements from the first
    span's start to the last one's end, ``inside`` the ``spans`` (anything with ``start`` and
    ``numel``, e.g. ``Span``) that overlap ``[lo, hi)``; ranges that none overlaps are skipped
    (the gaps between spans: padding)."""
    spans = sorted(spans, key=lambda s: s.start)
    if not spans:
        return
    end = max(s.start + s.numel for s in spans)
    first = 0  # spans before it end at or before the current range
    for lo in range(spans[0].start, end, chunk):
        hi = min(lo + chunk, end)
        while first < len(spans) and spans[first].start + spans[first].numel <= lo:
            first += 1
        inside = []
        for s in spans[first:]:
            if s.start >= hi:
                break
            inside.append(s)
        if inside:
            yield lo, hi, inside

"""Count device -> host reads made by megalite's own code (a ``set_sync_debug_mode`` for CPU).

On a GPU, ``tensor.item()``, ``bool(tensor)``, ``float(tensor)``, ``.tolist()``, ``.cpu()`` and
``.numpy()`` of a device tensor block the host until the device catches up. On CPU nothing
blocks, so this counter records those calls instead, when the caller's frame is a file of the
megalite package (torch's own CPU-side bookkeeping, e.g. AdamW's step counter on the host, is not
a device read and is not counted, nor are reads in ``megalite/data``, whose tensors are on the
host until the forward step moves them).
"""

from __future__ import annotations

import os
import sys
from collections import Counter

import torch

import megalite

PACKAGE_DIRS = tuple(
    os.path.dirname(os.path.abspath(m.__file__)) + os.sep
    for m in (megalite, __import__("megalite.kernels", fromlist=["_"]))
)
HOST_SIDE = (os.path.join(PACKAGE_DIRS[0], "data") + os.sep,)  # the loaders: host tensors
METHODS = ("item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__")


class SyncCounter:
    """``with SyncCounter() as c: ...``; ``c.mark(label)`` starts attributing reads to ``label``;
    ``c.counts[label]`` is how many reads happened under it, ``c.where[label]`` their callers."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.where: dict[str, list[str]] = {}
        self.label = "start"

    def mark(self, label: str) -> None:
        self.label = label

    def _wrap(self, name: str, original):
        counter = self

        def wrapper(self, *args, **kwargs):
            frame = sys._getframe(1)
            path = frame.f_code.co_filename
            if path.startswith(PACKAGE_DIRS) and not path.startswith(HOST_SIDE):
                counter.counts[counter.label] += 1
                counter.where.setdefault(counter.label, []).append(
                    f"{name} at {frame.f_code.co_filename}:{frame.f_lineno}"
                )
            return original(self, *args, **kwargs)

        return wrapper

    def __enter__(self) -> SyncCounter:
        self._saved = {name: getattr(torch.Tensor, name) for name in METHODS}
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, self._wrap(name, original))
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)

"""The most bytes of tensor storage alive at once during a piece of code, counted from the ops
that create them: CPU's stand-in for the CUDA allocator's peak (``max_memory_allocated``), which
CPU has no counter for.

    with LivePeak() as live:
        loss.backward()
    live.peak  # bytes

Every op's outputs are seen (a ``TorchDispatchMode``: forward, backward, views, in-place); a
storage counts once, from the first output on it until the last tensor on it is freed. What
existed before the block (parameters, inputs) is not counted, like the allocator's peak minus the
memory allocated at the start; allocator caching, fragmentation and workspaces are not either.
"""

from __future__ import annotations

import weakref

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode


class LivePeak(TorchDispatchMode):
    """The most bytes of tensor storage alive at once among those created while it is on (every
    op's outputs, forward and backward): CPU's stand-in for the allocator's peak. A storage is
    counted once, from its first output tensor until the last tensor on it is freed."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, list[int]] = {}  # storage address -> [tensors on it, nbytes]
        self.current = self.peak = 0

    def _free(self, ptr: int) -> None:
        entry = self.live[ptr]
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= entry[1]
            del self.live[ptr]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr == 0:
                continue
            if ptr not in self.live:
                self.live[ptr] = [0, storage.nbytes()]
                self.current += storage.nbytes()
                self.peak = max(self.peak, self.current)
            self.live[ptr][0] += 1
            weakref.finalize(t, self._free, ptr)
        return out

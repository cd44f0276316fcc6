"""Count the collectives and point-to-point messages a rank issues (not pure: patches
``torch.distributed`` for the duration of a ``with`` block).

    with CommLog() as log:
        trainer.step(...)
    log.counts()  # {("all_reduce", 2, 524288): 34, ("p2p", 2, 131072): 16, ...}

A record is ``(op, group size, bytes)``: the bytes of the full tensor as the planner counts them
(an all-reduce's tensor, an all-gather's output, a reduce-scatter's input, an all-to-all's input, a
sent message; a received message is not counted again). ``batch_isend_irecv`` records each send.
The planner's traffic model (``step_time.collectives``) is checked against these counts.
"""

from __future__ import annotations

from collections import Counter

import torch.distributed as dist

_OPS = {  # name in torch.distributed -> (the op as counted, which argument holds the bytes)
    "all_reduce": ("all_reduce", 0),
    "all_gather_single": ("all_gather", 0),
    "all_gather_into_tensor": ("all_gather", 0),
    "reduce_scatter_single": ("reduce_scatter", 1),
    "reduce_scatter_tensor": ("reduce_scatter", 1),
    "all_to_all_single": ("all_to_all", 1),
    "send": ("p2p", 0),
    "broadcast": ("broadcast", 0),
}


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


class CommLog:
    def __init__(self):
        self.records: list[tuple[str, int, int]] = []
        self._saved: dict[str, object] = {}

    def counts(self) -> Counter:
        return Counter(self.records)

    def _wrap(self, name: str, fn):
        op, arg = _OPS[name]

        def logged(*args, **kwargs):
            group = kwargs.get("group")
            size = dist.get_world_size(group) if op != "p2p" else 2
            tensor = args[arg] if len(args) > arg else kwargs.get("tensor", kwargs.get("input"))
            self.records.append((op, size, _nbytes(tensor)))
            return fn(*args, **kwargs)

        return logged

    def _batch(self, fn):
        def logged(ops, *args, **kwargs):
            for p in ops:
                if p.op is dist.isend:  # (never patched: P2POp checks it)
                    self.records.append(("p2p", 2, _nbytes(p.tensor)))
            return fn(ops, *args, **kwargs)

        return logged

    def __enter__(self) -> CommLog:
        for name in _OPS:
            if hasattr(dist, name):
                self._saved[name] = getattr(dist, name)
                setattr(dist, name, self._wrap(name, self._saved[name]))
        self._saved["batch_isend_irecv"] = dist.batch_isend_irecv
        dist.batch_isend_irecv = self._batch(self._saved["batch_isend_irecv"])
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        self._saved = {}

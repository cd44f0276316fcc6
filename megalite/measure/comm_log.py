"""Count the collectives and point-to-point messages a rank issues, as the planner counts them.

    with CommLog() as log:
        trainer.step(...)
    log.counts()  # {("all_reduce", 2, 524288): 34, ("p2p", 2, 131072): 16, ...}

A record is ``(op, group size, bytes)``: the bytes of the full tensor as the planner counts them
(an all-reduce's tensor, an all-gather's output, a reduce-scatter's input, an all-to-all's input, a
sent message; a received message is not counted again). Each send of a ``batch_isend_irecv`` is a
message. The planner's traffic model (``planning.traffic``) is checked against these counts.

``CommLog`` is a ``TorchDispatchMode``: every ``torch.distributed`` collective reaches the
dispatcher as a ``c10d`` op carrying its process group, which the mode reads on the way through.
Nothing is patched.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

# c10d op -> (the op as counted, the argument that holds the counted tensor, or a list of them)
_OPS = {
    "c10d::allreduce_": ("all_reduce", 0),  # dist.all_reduce
    "c10d::_allgather_base_": ("all_gather", 0),  # all_gather_single / _into_tensor: the output
    "c10d::_reduce_scatter_base_": ("reduce_scatter", 1),  # reduce_scatter_single / _tensor: input
    "c10d::alltoall_base_": ("all_to_all", 1),  # all_to_all_single: the input
    "c10d::broadcast_": ("broadcast", 0),
    "c10d::send": ("p2p", 0),  # send, isend (batch_isend_irecv's sends too)
}


def _nbytes(x: torch.Tensor | list[torch.Tensor]) -> int:
    tensors = x if isinstance(x, (list, tuple)) else [x]
    return sum(t.numel() * t.element_size() for t in tensors)


class CommLog(TorchDispatchMode):
    """``with CommLog() as log: ...``; then ``log.records`` / ``log.counts()``."""

    def __init__(self):
        super().__init__()
        self.records: list[tuple[str, int, int]] = []

    def counts(self) -> Counter:
        return Counter(self.records)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        counted = _OPS.get(func.name())
        if counted is not None:
            op, arg = counted
            if op == "p2p":
                size = 2
            else:  # the op's process group, as the dispatcher carries it
                group = next(a for a in args if isinstance(a, torch.ScriptObject))
                size = dist.ProcessGroup.unbox(group).size()
            self.records.append((op, size, _nbytes(args[arg])))
        return func(*args, **kwargs)

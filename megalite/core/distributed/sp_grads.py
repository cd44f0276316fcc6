"""All-reduce over TP the grads of parameters that see only a sequence shard.

Under sequence parallelism, norm weights (and the bias of a row-parallel layer) are replicated on
every TP rank but each rank computes its grad from ``s/tp`` positions; the true grad is the sum over
the TP group. The grads are flattened into one buffer so this is a single collective.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from megalite.core.groups import group_size


def sequence_parallel_params(params: Iterable[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    return [p for p in params if getattr(p, "sequence_parallel", False)]


def all_reduce_sequence_parallel_grads(
    params: Iterable[torch.nn.Parameter], tp_group, *, attr: str = "grad"
) -> None:
    """Sum ``p.<attr>`` (``grad``, or ``main_grad`` with a grad buffer) over ``tp_group`` for every
    parameter marked ``sequence_parallel``."""
    if group_size(tp_group) == 1:
        return
    grads = [getattr(p, attr, None) for p in sequence_parallel_params(params)]
    grads = [g for g in grads if g is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=tp_group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()

"""All-reduce over TP the grads of parameters that see only a sequence shard.

Under sequence parallelism, norm weights (and the bias of a row-parallel layer) are replicated on
every TP rank but each rank computes its grad from ``s/tp`` positions; the true grad is the sum over
the TP group. The grads are flattened into one buffer so this is a single collective.

The data-parallel wrappers do this sum on ``main_grad`` in ``finish_grad_sync``;
``all_reduce_sequence_parallel_grads`` does it on ``.grad`` for a model used without one (the
tensor-parallel equivalence tests).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from megalite.core.groups import all_reduce_flat
from megalite.core.param_attributes import is_sequence_parallel


def sequence_parallel_params(params: Iterable[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    return [p for p in params if is_sequence_parallel(p)]


def all_reduce_sequence_parallel_grads(params: Iterable[torch.nn.Parameter], tp_group) -> None:
    """Sum ``p.grad`` over ``tp_group`` for every parameter marked ``sequence_parallel`` (those
    without a grad are skipped)."""
    grads = [p.grad for p in sequence_parallel_params(params) if p.grad is not None]
    all_reduce_flat(grads, tp_group)

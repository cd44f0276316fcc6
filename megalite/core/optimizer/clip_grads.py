"""Global gradient-norm clipping across a model sharded over TP and PP (and replicated over DP).

The global norm is that of the unsharded model, each parameter counted once:

- a TP-sharded parameter (``tensor_model_parallel``) contributes its shard from every TP rank;
- a TP-replicated parameter (norm weights, row-parallel biases) only from TP rank 0;
- a parameter listed in ``duplicates`` (the last stage's copy of a tied word embedding when PP > 1)
  not at all;

then the squared norms are summed over the model-parallel group (TP x PP). After the data-parallel
all-reduce every DP replica holds the same grads, so no reduction over DP is needed. The clip
multiplies every grad (counted or not) by ``min(1, max_norm / (norm + 1e-6))``, as
``torch.nn.utils.clip_grad_norm_`` does, without a host synchronisation.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist

from megalite.core.tensor_parallel.mappings import group_size


def param_is_counted(
    param: torch.Tensor, *, tp_rank: int, duplicates: Iterable[torch.Tensor] = ()
) -> bool:
    """Whether this rank's ``param`` enters the global norm (see the module docstring)."""
    if any(param is d for d in duplicates):
        return False
    return bool(getattr(param, "tensor_model_parallel", False)) or tp_rank == 0


def global_grad_norm(
    grads_for_norm: list[torch.Tensor], *, mp_group, norm_type: float = 2.0
) -> torch.Tensor:
    """The norm (fp32 0-d tensor) of the grads every model-parallel rank counts, combined over
    ``mp_group``. ``norm_type`` 2 or inf. Non-finite grads give a non-finite norm."""
    device = grads_for_norm[0].device if grads_for_norm else torch.device("cpu")
    if norm_type == math.inf:
        local = torch.zeros((), dtype=torch.float32, device=device)
        for g in grads_for_norm:
            local = torch.maximum(local, g.detach().abs().max().float())
        if group_size(mp_group) > 1:
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=mp_group)
        return local
    if norm_type != 2.0:
        raise ValueError(f"norm_type must be 2 or inf, got {norm_type}")
    local = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads_for_norm:
        local = local + torch.linalg.vector_norm(g.detach(), 2, dtype=torch.float32).square()
    if group_size(mp_group) > 1:
        dist.all_reduce(local, group=mp_group)
    return local.sqrt()


def clip_grads_by_norm(
    grads: list[torch.Tensor], total_norm: torch.Tensor, max_norm: float
) -> None:
    """Multiply ``grads`` in place by ``min(1, max_norm / (total_norm + 1e-6))``."""
    if not grads:
        return
    coeff = (max_norm / (total_norm + 1e-6)).clamp(max=1.0)
    torch._foreach_mul_(grads, coeff.to(grads[0].device))


def clip_grad_norm(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    max_norm: float,
    *,
    mp_group,
    tp_rank: int,
    duplicates: Iterable[torch.Tensor] = (),
    norm_type: float = 2.0,
) -> torch.Tensor:
    """Global norm of ``grads`` (``grads[i]`` belongs to ``params[i]``, whose attributes decide
    whether it is counted) and, if ``max_norm > 0``, clip them in place. Returns the norm before
    clipping as a 0-d fp32 tensor."""
    if len(params) != len(grads):
        raise ValueError(f"{len(params)} params but {len(grads)} grads")
    duplicates = list(duplicates)
    counted = [
        g
        for p, g in zip(params, grads)
        if param_is_counted(p, tp_rank=tp_rank, duplicates=duplicates)
    ]
    total = global_grad_norm(counted, mp_group=mp_group, norm_type=norm_type)
    if max_norm > 0:
        clip_grads_by_norm(grads, total, max_norm)
    return total

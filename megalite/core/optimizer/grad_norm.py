"""The global gradient norm of a model sharded over TP, PP and (ZeRO) DP, and clipping by it.

The global norm is that of the unsharded model, each parameter counted once
(``param_is_counted``):

- a TP-sharded parameter (``tensor_model_parallel``) contributes its shard from every TP rank;
- a TP-replicated parameter (norm weights, row-parallel biases) only from TP rank 0;
- a parameter of a grid mode (2d, 2.5d, 3d) from the TP ranks that hold its distinct blocks
  (``distinct_tp_ranks``; 2d: the first q x q for a weight, the first q for a bias or a norm
  scale; 3d: coordinate 0 on each sub-axis it is replicated along);
- a parameter listed in ``duplicates`` (the last stage's copy of a tied word embedding when PP > 1)
  not at all;

then the local sums are reduced over each of ``groups`` in turn: the model-parallel group (TP x PP)
for replicated optimizer state (after the DP all-reduce every replica holds the same grads), the
DP group then the model-parallel group under ZeRO (each DP rank holds a shard of the grads).

Expert (MoE) parameters live on another mesh view (etp x ep x edp x pp): their squares are summed
over ``expert_groups`` (the expert model-parallel group ``etp x ep x pp``, preceded by ``edp``
under ZeRO), the dense ones over ``groups``, and the two totals added, so each parameter is
counted once (an expert parameter replicated over expert TP only from expert-TP rank 0). The
clip multiplies every grad (counted or not) by ``min(1, max_norm / (norm + 1e-6))``, as
``torch.nn.utils.clip_grad_norm_`` does, without a host synchronisation.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

from megalite.core.groups import all_reduce_tensor, group_size
from megalite.core.param_attributes import distinct_tp_ranks, is_expert_param, is_tensor_parallel


def param_is_counted(
    param: torch.Tensor,
    *,
    tp_rank: int,
    duplicates: Iterable[torch.Tensor] = (),
    expert_tp_rank: int = 0,
) -> bool:
    """Whether this rank's ``param`` enters the global norm (see the module docstring)."""
    if any(param is d for d in duplicates):
        return False
    if is_expert_param(param):
        return is_tensor_parallel(param) or expert_tp_rank == 0
    if distinct_tp_ranks(param) is not None:
        return tp_rank in distinct_tp_ranks(param)
    return is_tensor_parallel(param) or tp_rank == 0


def all_reduce_over(t: torch.Tensor, groups: Sequence, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """``t`` reduced in place over each group of ``groups`` in turn (groups of one skipped)."""
    for group in groups:
        if group_size(group) > 1:
            all_reduce_tensor(t, group, op=op)
    return t


def _local(grads: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """This rank's sum of squares (or max) of ``grads``, an fp32 0-d tensor."""
    local = torch.zeros((), dtype=torch.float32, device=device)
    if grads:
        norms = torch.stack(torch._foreach_norm(grads, norm_type)).float().to(device)
        local = norms.max() if norm_type == math.inf else norms.square().sum()
    return local


def grad_norm(
    grads: list[torch.Tensor],
    *,
    groups: Sequence = (),
    norm_type: float = 2.0,
    device: torch.device | None = None,
    expert_grads: list[torch.Tensor] | None = None,
    expert_groups: Sequence = (),
) -> torch.Tensor:
    """The ``norm_type`` (2 or inf) norm, an fp32 0-d tensor, of ``grads`` (the ones this rank
    counts) combined over ``groups``, and with ``expert_grads`` (not None) those combined over
    ``expert_groups``. Non-finite grads give a non-finite norm. No host sync."""
    if device is None:
        first = grads or expert_grads or []
        device = first[0].device if first else torch.device("cpu")
    if norm_type not in (2.0, math.inf):
        raise ValueError(f"norm_type must be 2 or inf, got {norm_type}")
    op = dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM
    total = all_reduce_over(_local(grads, norm_type, device), groups, op)
    if expert_grads is not None:
        expert = all_reduce_over(_local(expert_grads, norm_type, device), expert_groups, op)
        total = torch.maximum(total, expert) if norm_type == math.inf else total + expert
    return total if norm_type == math.inf else total.sqrt()


def clip_grads_by_norm(
    grads: list[torch.Tensor], total_norm: torch.Tensor, max_norm: float
) -> None:
    """Multiply ``grads`` in place by ``min(1, max_norm / (total_norm + 1e-6))``."""
    if not grads:
        return
    torch._foreach_mul_(grads, clip_coefficient(total_norm, max_norm).to(grads[0].device))


def clip_coefficient(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``min(1, max_norm / (total_norm + 1e-6))``, a 0-d tensor (no host sync)."""
    return (max_norm / (total_norm + 1e-6)).clamp(max=1.0)

"""Build the AdamW optimizer (plain or ZeRO-1) with Megatron's parameter groups.

Weight decay applies to matrices (linear weights, embeddings) only: biases and norm weights (every
1-D parameter, and anything named ``*.bias``) form a group with ``weight_decay = 0``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from megalite.core.distributed.zero_data_parallel import ZeroDataParallel
from megalite.core.optimizer.distributed_optimizer import DistributedOptimizer
from megalite.core.optimizer.loss_scaler import LossScaler
from megalite.core.optimizer.unsharded_optimizer import UnshardedOptimizer


def is_no_weight_decay(name: str, param: torch.Tensor) -> bool:
    return name.endswith(".bias") or name == "bias" or param.ndim == 1


def get_param_groups(model: nn.Module, *, weight_decay: float) -> list[dict]:
    """``[{"params": decayed, "weight_decay": wd}, {"params": rest, "weight_decay": 0.0}]`` over
    the trainable parameters of ``model`` (each once, tied parameters included once); empty groups
    are dropped."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if is_no_weight_decay(name, param) else decay).append(param)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def adamw_factory(
    *, lr: float, weight_decay: float, adam_beta1: float, adam_beta2: float, adam_eps: float
) -> Callable[[list[dict]], torch.optim.Optimizer]:
    """The inner AdamW both optimizers (plain and ZeRO-1) build over their fp32 param groups."""

    def build_inner(groups: list[dict]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(
            groups, lr=lr, betas=(adam_beta1, adam_beta2), eps=adam_eps, weight_decay=weight_decay
        )

    return build_inner


def build_optimizer(
    model: nn.Module,
    *,
    lr: float,
    weight_decay: float,
    adam_beta1: float = 0.9,
    adam_beta2: float = 0.999,
    adam_eps: float = 1e-8,
    clip_grad: float = 1.0,
    mp_group=None,
    tp_rank: int = 0,
    duplicates: Iterable[torch.Tensor] = (),
    loss_scaler: LossScaler | None = None,
    count_zeros: bool = False,
    expert_mp_group=None,
    expert_tp_rank: int = 0,
) -> UnshardedOptimizer | DistributedOptimizer:
    """AdamW over fp32 masters of ``model``'s parameters: the state whole on every DP rank, or
    sharded over DP (ZeRO-1) when ``model`` is a ``ZeroDataParallel``.

    ``lr`` is the initial learning rate; the scheduler overwrites it every step.
    ``expert_mp_group`` (``ps.group("etp", "ep", "pp")``) and ``expert_tp_rank``: where the grad
    norm of expert (MoE) parameters is reduced and which expert-TP rank counts replicated ones.
    """
    build_inner = adamw_factory(
        lr=lr, weight_decay=weight_decay, adam_beta1=adam_beta1, adam_beta2=adam_beta2,
        adam_eps=adam_eps,
    )  # fmt: skip
    sharded = isinstance(model, ZeroDataParallel)  # ZeRO-1: the optimizer state over DP
    return (DistributedOptimizer if sharded else UnshardedOptimizer)(
        get_param_groups(model, weight_decay=weight_decay),
        build_inner,
        model=model,
        clip_grad=clip_grad,
        mp_group=mp_group,
        tp_rank=tp_rank,
        duplicates=duplicates,
        loss_scaler=loss_scaler,
        count_zeros=count_zeros,
        expert_mp_group=expert_mp_group,
        expert_tp_rank=expert_tp_rank,
    )


def build_distributed_optimizer(model: ZeroDataParallel, **kwargs) -> DistributedOptimizer:
    """``build_optimizer``'s AdamW and weight-decay groups, sharded over DP (ZeRO-1): the model
    must be wrapped in ``ZeroDataParallel``. Keyword arguments as ``build_optimizer``."""
    if not isinstance(model, ZeroDataParallel):
        raise TypeError(
            f"the distributed optimizer needs the model wrapped in ZeroDataParallel, got "
            f"{type(model).__name__}"
        )
    return build_optimizer(model, **kwargs)

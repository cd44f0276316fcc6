"""Build the AdamW optimizer (unsharded, or sharded over DP on a ZeRO rung) with Megatron's
parameter groups.

Weight decay applies to matrices (linear weights, embeddings) only: biases and norm weights (every
1-D parameter, and anything named ``*.bias``) form a group with ``weight_decay = 0``.

``decoupled_lr`` / ``decoupled_min_lr``: the input word embedding and the output
layer weight (every copy of a tied one: Megatron marks the embedding of the first stage and the
output weight of the last) form groups of their own carrying ``max_lr`` / ``min_lr``, which the LR
schedule reads. Position embeddings are not among them, as in Megatron. The groups pass unchanged
into every optimizer rung (plain, ZeRO-1/2/3: the sharded inner optimizer gets one group per
model group).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from megalite.core.distributed.data_parallel import DistributedDataParallel
from megalite.core.distributed.zero1_data_parallel import Zero1DataParallel
from megalite.core.optimizer.compressed import (
    COMPRESSED_OPTIMIZERS,
    OPTIMIZERS,
    CompressionSpec,
    OneBitAdam,
    OneBitLamb,
)
from megalite.core.optimizer.compressed_optimizer import CompressedOptimizer
from megalite.core.optimizer.lamb import Lamb
from megalite.core.optimizer.loss_scaler import LossScaler
from megalite.core.optimizer.sharded_optimizer import ShardedOptimizer
from megalite.core.optimizer.sharded_state import OffloadSpec
from megalite.core.optimizer.unsharded_optimizer import UnshardedOptimizer
from megalite.core.optimizer.zero_one_adam import ZeroOneAdam


def is_no_weight_decay(name: str, param: torch.Tensor) -> bool:
    return name.endswith(".bias") or name == "bias" or param.ndim == 1


DECOUPLED_LR_SUFFIXES = ("embedding.word_embeddings.weight", "output_layer.weight")


def is_embedding_or_output(name: str) -> bool:
    """Megatron's ``is_embedding_or_output_parameter``: the word embedding or output weight."""
    return name.endswith(DECOUPLED_LR_SUFFIXES)


def get_param_groups(
    model: nn.Module,
    *,
    weight_decay: float,
    decoupled_lr: float | None = None,
    decoupled_min_lr: float | None = None,
) -> list[dict]:
    """``[{"params": decayed, "weight_decay": wd}, {"params": rest, "weight_decay": 0.0}]`` over
    the trainable parameters of ``model`` (each once, tied parameters included once); empty groups
    are dropped. With ``decoupled_lr`` the embedding / output weights (``is_embedding_or_output``)
    go into groups after those, with ``"max_lr": decoupled_lr`` (and ``"min_lr":
    decoupled_min_lr`` when given; else the run's ``min_lr``)."""
    if decoupled_min_lr is not None and decoupled_lr is None:
        raise ValueError("decoupled_min_lr needs decoupled_lr (the rate it decays from)")
    decay, no_decay, decay_dec, no_decay_dec = [], [], [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        decoupled = decoupled_lr is not None and is_embedding_or_output(name)
        if is_no_weight_decay(name, param):
            (no_decay_dec if decoupled else no_decay).append(param)
        else:
            (decay_dec if decoupled else decay).append(param)
    rates = {} if decoupled_lr is None else {"max_lr": decoupled_lr}
    if decoupled_min_lr is not None:
        rates["min_lr"] = decoupled_min_lr
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
        {"params": decay_dec, "weight_decay": weight_decay, **rates},
        {"params": no_decay_dec, "weight_decay": 0.0, **rates},
    ]
    return [g for g in groups if g["params"]]


def fused_adam_serves(groups: list[dict]) -> bool:
    """Whether torch's fused AdamW takes these param groups: every param on CUDA (masters held
    on the host, wholly or in part, keep the default path, which the CPU tests' oracles use)."""
    devices = {p.device.type for g in groups for p in g["params"]}
    return devices == {"cuda"}


def adamw_factory(
    *, lr: float, weight_decay: float, adam_beta1: float, adam_beta2: float, adam_eps: float
) -> Callable[[list[dict]], torch.optim.Optimizer]:
    """The inner AdamW both optimizers (unsharded and sharded) build over their fp32 param
    groups: torch's fused kernel when every master is on CUDA (one launch per few tensors, where
    the foreach path launches one per operation: on a 1.3B model on an H100 about 13 ms a step
    against 40), the default path otherwise."""

    def build_inner(groups: list[dict]) -> torch.optim.Optimizer:
        fused = fused_adam_serves(groups)
        return torch.optim.AdamW(
            groups,
            lr=lr,
            betas=(adam_beta1, adam_beta2),
            eps=adam_eps,
            weight_decay=weight_decay,
            fused=fused or None,
        )

    return build_inner


def inner_factory(
    optimizer: str,
    model: nn.Module,
    *,
    lr: float,
    weight_decay: float,
    adam_beta1: float,
    adam_beta2: float,
    adam_eps: float,
    compression: CompressionSpec,
    lamb_trust_ratio: tuple[float, float],
) -> Callable[[list[dict]], torch.optim.Optimizer]:
    """The inner optimizer ``optimizer`` (one of ``OPTIMIZERS``) over fp32 param groups. LAMB's
    norms add over ``model``'s TP group, the compressed momenta over its DP groups (expert
    parameters over the expert one); a bare module is a group of one."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")
    if optimizer == "adam":
        return adamw_factory(
            lr=lr,
            weight_decay=weight_decay,
            adam_beta1=adam_beta1,
            adam_beta2=adam_beta2,
            adam_eps=adam_eps,
        )
    wrapped = isinstance(model, DistributedDataParallel)
    groups = {
        "dp_group": model.dp_group if wrapped else None,
        "expert_dp_group": model.expert_dp_group if wrapped else None,
    }
    common = {"lr": lr, "betas": (adam_beta1, adam_beta2), "eps": adam_eps}
    common["weight_decay"] = weight_decay
    lamb = {
        "min_trust_ratio": lamb_trust_ratio[0],
        "max_trust_ratio": lamb_trust_ratio[1],
        "tp_group": model.tp_group if wrapped else None,
    }

    def build_inner(param_groups: list[dict]) -> torch.optim.Optimizer:
        if optimizer == "lamb":
            return Lamb(param_groups, **common, **lamb)
        if optimizer == "onebit-lamb":
            return OneBitLamb(
                param_groups,
                freeze_step=compression.freeze_step,
                factor_max=compression.factor_max,
                factor_min=compression.factor_min,
                factor_threshold=compression.factor_threshold,
                **groups,
                **common,
                **lamb,
            )
        if optimizer == "onebit-adam":
            return OneBitAdam(param_groups, freeze_step=compression.freeze_step, **groups, **common)
        return ZeroOneAdam(
            param_groups,
            var_freeze_step=compression.var_freeze_step,
            var_update_scaler=compression.var_update_scaler,
            local_step_scaler=compression.local_step_scaler,
            local_step_clipper=compression.local_step_clipper,
            **groups,
            **common,
        )

    return build_inner


def build_optimizer(
    model: nn.Module,
    *,
    optimizer: str = "adam",
    compression: CompressionSpec | None = None,
    lamb_trust_ratio: tuple[float, float] = (0.01, 10.0),
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
    offload: OffloadSpec | None = None,
    decoupled_lr: float | None = None,
    decoupled_min_lr: float | None = None,
) -> UnshardedOptimizer | ShardedOptimizer:
    """AdamW over fp32 masters of ``model``'s parameters: the state whole on every DP rank, or
    sharded over DP (``ShardedOptimizer``) when ``model`` is a sharded rung (``Zero1DataParallel``
    or its subclasses ``Zero2DataParallel``, ``Zero3DataParallel``).

    ``lr`` is the initial learning rate; the scheduler overwrites it every step.
    ``expert_mp_group`` (``ps.group("etp", "ep", "pp")``) and ``expert_tp_rank``: where the grad
    norm of expert (MoE) parameters is reduced and which expert-TP rank counts replicated ones.
    ``offload``: part of the sharded state (and its step) on the host or in files (sharded only).
    ``decoupled_lr`` / ``decoupled_min_lr``: the embedding / output weights' own rates
    (``get_param_groups``). ``optimizer``: ``adam`` (AdamW), ``lamb``, or a compressed one
    (``compressed``: ``onebit-adam``, ``zero-one-adam``, ``onebit-lamb``, with ``compression``'s
    schedules; unsharded only); ``lamb_trust_ratio``: LAMB's (min, max) trust ratio.
    """
    build_inner = inner_factory(
        optimizer,
        model,
        lr=lr,
        weight_decay=weight_decay,
        adam_beta1=adam_beta1,
        adam_beta2=adam_beta2,
        adam_eps=adam_eps,
        compression=compression or CompressionSpec(),
        lamb_trust_ratio=lamb_trust_ratio,
    )
    sharded = isinstance(model, Zero1DataParallel)  # ZeRO-1, 2 or 3: the state over DP
    compressed = optimizer in COMPRESSED_OPTIMIZERS
    if sharded and optimizer != "adam":
        raise ValueError(
            f"optimizer {optimizer!r} needs the state whole on every DP rank (no ZeRO)"
        )
    extra = {}
    if offload is not None:
        if not sharded:
            raise ValueError("optimizer offload needs a sharded rung (ZeRO-1, 2 or 3)")
        extra["offload"] = offload
    param_groups = get_param_groups(
        model,
        weight_decay=weight_decay,
        decoupled_lr=decoupled_lr,
        decoupled_min_lr=decoupled_min_lr,
    )
    kind = (
        ShardedOptimizer if sharded else CompressedOptimizer if compressed else UnshardedOptimizer
    )
    return kind(
        param_groups,
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
        **extra,
    )


def build_sharded_optimizer(model: Zero1DataParallel, **kwargs) -> ShardedOptimizer:
    """``build_optimizer``'s AdamW and weight-decay groups, sharded over DP: the model must be
    wrapped in a sharded rung (``Zero1DataParallel`` or a subclass). Keyword arguments as
    ``build_optimizer``."""
    if not isinstance(model, Zero1DataParallel):
        raise TypeError(
            f"the sharded optimizer needs the model wrapped in Zero1DataParallel (or ZeRO-2/3), "
            f"got {type(model).__name__}"
        )
    return build_optimizer(model, **kwargs)

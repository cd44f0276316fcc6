"""One mixed-precision optimizer family: ``UnshardedOptimizer`` (state whole on every DP rank) and
ZeRO-1's ``ShardedOptimizer``, both ``MixedPrecisionOptimizer``; their builders, the loss
scalers, the grad norm, and the offline conversion of ZeRO-1 shards to the full state."""

from __future__ import annotations

from megalite.core.optimizer.builders import (
    adamw_factory,
    build_optimizer,
    build_sharded_optimizer,
    get_param_groups,
)
from megalite.core.optimizer.grad_norm import clip_grads_by_norm, grad_norm, param_is_counted
from megalite.core.optimizer.loss_scaler import ConstantLossScaler, DynamicLossScaler, LossScaler
from megalite.core.optimizer.mixed_precision import MixedPrecisionOptimizer
from megalite.core.optimizer.sharded_optimizer import ShardedOptimizer
from megalite.core.optimizer.sharded_state import OffloadSpec
from megalite.core.optimizer.unsharded_optimizer import UnshardedOptimizer
from megalite.core.optimizer.zero1_checkpoint import full_state_from_shards

__all__ = [
    "ConstantLossScaler",
    "ShardedOptimizer",
    "DynamicLossScaler",
    "LossScaler",
    "MixedPrecisionOptimizer",
    "OffloadSpec",
    "UnshardedOptimizer",
    "adamw_factory",
    "build_sharded_optimizer",
    "build_optimizer",
    "clip_grads_by_norm",
    "full_state_from_shards",
    "get_param_groups",
    "grad_norm",
    "param_is_counted",
]

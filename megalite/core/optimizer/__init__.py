"""One mixed-precision optimizer family: ``UnshardedOptimizer`` (state whole on every DP rank) and
``ShardedOptimizer`` (state sharded over DP, for every ZeRO rung, with optional offload), both
``MixedPrecisionOptimizer``; their builders, the loss scalers, the grad norm, and the offline
conversion of the per-DP-rank sharded states to the full state."""

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
from megalite.core.optimizer.sharded_state_format import full_state_from_shards
from megalite.core.optimizer.unsharded_optimizer import UnshardedOptimizer

__all__ = [
    "ConstantLossScaler",
    "DynamicLossScaler",
    "LossScaler",
    "MixedPrecisionOptimizer",
    "OffloadSpec",
    "ShardedOptimizer",
    "UnshardedOptimizer",
    "adamw_factory",
    "build_optimizer",
    "build_sharded_optimizer",
    "clip_grads_by_norm",
    "full_state_from_shards",
    "get_param_groups",
    "grad_norm",
    "param_is_counted",
]

"""Mixture of experts: router, token dispatchers (all-to-all, allgather), grouped experts."""

from megalite.core.moe.aux_loss import attach_aux_loss
from megalite.core.moe.config import MoEConfig
from megalite.core.moe.experts import GroupedExperts
from megalite.core.moe.layer import MoELayer
from megalite.core.moe.router import (
    TopKRouter,
    routers_of,
    set_aux_loss_scale,
    update_expert_bias,
)

__all__ = [
    "GroupedExperts",
    "MoEConfig",
    "MoELayer",
    "TopKRouter",
    "attach_aux_loss",
    "routers_of",
    "set_aux_loss_scale",
    "update_expert_bias",
]

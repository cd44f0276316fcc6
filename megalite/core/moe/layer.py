"""MoELayer: router + token dispatcher + experts, in place of a transformer layer's MLP.

Input and output # [s, b, h] ([s/tp, b, h] under sequence parallel). The layer works on this
rank's tokens: under sequence parallel those of its sequence shard; without it (TP > 1) each TP
rank takes its ``1/tp`` of the replicated tokens and the outputs are all-gathered at the end, so
experts see each token once either way. Groups (from ``ParallelState``): ``tp_group`` (dense TP),
``seq_group`` (tp x cp: one micro-batch's tokens, for the router's statistics), ``batch_group``
(tp x cp x dp: the data-parallel micro-step's tokens, for ``global_aux_loss``), ``ep_group``,
``etp_group`` and ``expert_group`` (etp x ep, the allgather dispatcher's).

Expert grads: an expert sees the tokens of every rank of its ETP x EP group, so its grad is already
summed over them; the data-parallel layer sums it over edp and divides by the dense dp x cp size
(Megatron's scaling), which makes it the mean over dp x cp like every dense grad.
"""

from __future__ import annotations

import torch
from torch import nn

from megalite.core.groups import group_size
from megalite.core.moe.config import MoEConfig
from megalite.core.moe.experts import GroupedExperts
from megalite.core.moe.router import TopKRouter
from megalite.core.moe.token_dispatcher import AllGatherDispatcher, AllToAllDispatcher
from megalite.core.tensor_parallel.init import InitMethod
from megalite.core.tensor_parallel.mappings import gather_from_sp_region, scatter_to_sp_region


class MoELayer(nn.Module):
    def __init__(
        self,
        config: MoEConfig,
        *,
        tp_group,
        seq_group,
        cp_size: int,
        ep_group,
        ep_rank: int,
        etp_group,
        expert_group,
        sequence_parallel: bool,
        init_router: InitMethod,
        init_fc1,
        init_fc2,
        batch_group=None,
        device: torch.device | None = None,
    ):
        super().__init__()
        ep_size = group_size(ep_group)
        config.validate(ep_size=ep_size, etp_size=group_size(etp_group))
        self.config, self.tp_group = config, tp_group
        self.split_tokens = not sequence_parallel and group_size(tp_group) > 1
        self.router = TopKRouter(
            config,
            seq_group=seq_group,
            cp_size=cp_size,
            init_method=init_router,
            batch_group=batch_group,
            device=device,
        )
        self.experts = GroupedExperts(
            config,
            ep_rank=ep_rank,
            ep_size=ep_size,
            etp_group=etp_group,
            init_fc1=init_fc1,
            init_fc2=init_fc2,
            device=device,
        )
        if config.token_dispatcher_type == "alltoall":
            self.dispatcher = AllToAllDispatcher(
                num_experts=config.num_experts,
                ep_group=ep_group,
                etp_group=etp_group,
                capacity_factor=config.expert_capacity_factor,
                topk=config.router_topk,
                pad_to_capacity=config.pad_expert_input_to_capacity,
            )
        else:
            self.dispatcher = AllGatherDispatcher(
                num_experts=config.num_experts,
                ep_rank=ep_rank,
                ep_size=ep_size,
                expert_group=expert_group,
            )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.split_tokens:  # [s, b, h] replicated over TP -> this rank's [s/tp, b, h]
            hidden = scatter_to_sp_region(hidden, self.tp_group)
        s, b, h = hidden.shape
        tokens = hidden.reshape(s * b, h)  # token t = position t // b of sequence t % b
        probs, routing_map = self.router(tokens, b)
        out = self.dispatcher(tokens, probs, routing_map, self.experts).view(s, b, h)
        if self.split_tokens:
            out = gather_from_sp_region(out, self.tp_group, grad_is_partial=False)
        return out

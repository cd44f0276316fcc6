"""TopKRouter: scores every token against every expert (fp32) and picks its top-k experts.

Scores (``router_score_function``, ``router_pre_softmax``):
- softmax: top-k of the logits, then softmax over those k (Mixtral); with ``pre_softmax``, softmax
  over all experts, then top-k of the probabilities, not renormalised (Qwen2-MoE).
- sigmoid: sigmoid of the logits; top-k (of score + expert bias, when on), probabilities = the
  chosen scores normalised to sum 1 (k > 1).

Capacity (``expert_capacity_factor``): each expert keeps at most
``ceil(tokens * k / E * factor)`` of this rank's tokens, the most probable (``probs``) or the first
(``position``); the others are dropped for that expert. Without a factor nothing is dropped.

Expert bias (``router_enable_expert_bias``, aux-loss-free balancing): a buffer added to the
scores for the choice only; after each step ``update_expert_bias`` moves it by
``rate * sign(mean load - load)`` from the step's token counts summed over the whole batch.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megalite.core.groups import all_reduce_tensor, group_size
from megalite.core.moe.aux_loss import (
    attach_aux_loss,
    aux_loss_partial,
    global_aux_loss_partial,
    seq_aux_loss_partial,
    sum_over,
    z_loss_partial,
)
from megalite.core.moe.config import MoEConfig
from megalite.core.tensor_parallel.init import InitMethod


def expert_capacity(num_tokens: int, num_experts: int, topk: int, factor: float) -> int:
    return math.ceil(num_tokens * topk / num_experts * factor)


class TopKRouter(nn.Module):
    """``forward(x # [T, h], batch_size)`` -> (probs # [T, E] fp32, zero where not routed or
    dropped; routing_map # [T, E] bool, the kept choices). The aux and z losses join the backward
    through ``probs`` (``aux_loss.attach_aux_loss``). ``seq_group`` spans the micro-batch's tokens
    (tp x cp); ``cp_size`` for the losses' scaling (``aux_loss``); ``batch_group`` (tp x cp x
    dp, default ``seq_group``) spans the data-parallel micro-step (``global_aux_loss``)."""

    def __init__(
        self,
        config: MoEConfig,
        *,
        seq_group,
        cp_size: int,
        init_method: InitMethod,
        batch_group=None,
        device: torch.device | None = None,
    ):
        super().__init__()
        self.config, self.seq_group, self.cp_size = config, seq_group, cp_size
        self.batch_group = seq_group if batch_group is None else batch_group
        e = config.num_experts
        full = torch.empty(e, config.hidden_size, dtype=torch.float32)
        init_method(full)
        self.weight = nn.Parameter(full.to(device=device, dtype=config.params_dtype))
        self.weight.tensor_model_parallel, self.weight.partition_dim = False, None
        self.weight.sequence_parallel = True  # sees this rank's tokens only: grads summed over TP
        bias = torch.zeros(e, dtype=torch.float32, device=device)
        self.register_buffer("expert_bias", bias if config.router_enable_expert_bias else None)
        # per step: tokens routed to each expert from this rank (for the expert-bias update)
        self.register_buffer(
            "local_tokens_per_expert", torch.zeros(e, device=device), persistent=False
        )
        # since the last read: [aux loss part, z loss part, micro-batches, tokens per expert...]
        self.register_buffer("stats", torch.zeros(3 + e, device=device), persistent=False)
        self.aux_loss_scale = 1.0  # set_aux_loss_scale: loss scale / number of micro-batches
        # global_aux_loss: tokens per expert summed over the step's micro-steps (tp x cp x dp)
        is_global = config.router_load_balancing_type == "global_aux_loss"
        zeros = torch.zeros(e, device=device) if is_global else None
        self.register_buffer("global_tokens_per_expert", zeros, persistent=False)
        steps = torch.zeros((), device=device) if is_global else None
        self.register_buffer("global_micro_steps", steps, persistent=False)

    def _scores(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(top-k probs # [T, k], their experts # [T, k], scores for the aux loss # [T, E])."""
        c, k = self.config, self.config.router_topk
        if c.router_score_function == "softmax":
            aux_scores = torch.softmax(logits, dim=-1)
            if c.router_pre_softmax:
                probs, top = torch.topk(aux_scores, k, dim=-1)
            else:
                top_logits, top = torch.topk(logits, k, dim=-1)
                probs = torch.softmax(top_logits, dim=-1)
            return probs, top, aux_scores
        scores = torch.sigmoid(logits)
        aux_scores = scores / (scores.sum(-1, keepdim=True) + 1e-20)
        if self.expert_bias is not None:
            _, top = torch.topk(scores + self.expert_bias, k, dim=-1)
            probs = scores.gather(1, top)
        else:
            probs, top = torch.topk(scores, k, dim=-1)
        if k > 1:
            probs = probs / (probs.sum(-1, keepdim=True) + 1e-20)
        return probs, top, aux_scores

    def _drop(self, probs_full: torch.Tensor, routing_map: torch.Tensor) -> torch.Tensor:
        """The routing map with each expert's tokens past its capacity removed."""
        c = self.config
        num_tokens, e = routing_map.shape
        cap = expert_capacity(num_tokens, e, c.router_topk, c.expert_capacity_factor)
        if cap >= num_tokens:
            return routing_map
        if c.token_drop_policy == "position":
            return routing_map & (routing_map.long().cumsum(0) <= cap)
        ranked = probs_full.masked_fill(~routing_map, -1.0)
        keep = torch.zeros_like(routing_map)
        keep.scatter_(0, torch.topk(ranked, cap, dim=0).indices, True)
        return routing_map & keep

    def _global_aux_loss(
        self, aux_scores: torch.Tensor, routing_map: torch.Tensor, counting: bool
    ) -> torch.Tensor:
        """This rank's part of the ``global_aux_loss`` of the data-parallel micro-step."""
        c = self.config
        counts = sum_over(routing_map.sum(0).float(), self.batch_group)  # [E]
        if counting:  # training: the running mean over the step's micro-steps so far
            self.global_tokens_per_expert += counts
            self.global_micro_steps += 1
            counts = self.global_tokens_per_expert / self.global_micro_steps
        batch = group_size(self.batch_group)
        return global_aux_loss_partial(
            aux_scores,
            counts,
            total_tokens=aux_scores.shape[0] * batch,
            topk=c.router_topk,
            coeff=c.aux_loss_coeff,
            grad_share=batch * self.cp_size // group_size(self.seq_group),
        )

    def forward(self, x: torch.Tensor, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        logits = F.linear(x.float(), self.weight.float())  # [T, E] fp32
        probs, top, aux_scores = self._scores(logits)
        routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, top, True)
        probs_full = torch.zeros_like(logits).scatter(1, top, probs)  # [T, E]
        common = dict(seq_group=self.seq_group, cp_size=self.cp_size)
        aux = None
        if c.router_load_balancing_type == "aux_loss" and c.aux_loss_coeff > 0:
            aux = aux_loss_partial(
                aux_scores, routing_map, topk=c.router_topk, coeff=c.aux_loss_coeff, **common
            )
        elif c.router_load_balancing_type == "seq_aux_loss" and c.aux_loss_coeff > 0:
            aux = seq_aux_loss_partial(
                aux_scores,
                routing_map,
                batch_size=batch_size,
                topk=c.router_topk,
                coeff=c.aux_loss_coeff,
                **common,
            )
        counting = self.training and torch.is_grad_enabled()  # not in eval or a no-grad pass
        if c.router_load_balancing_type == "global_aux_loss" and c.aux_loss_coeff > 0:
            aux = self._global_aux_loss(aux_scores, routing_map, counting)
        z = None
        if c.z_loss_coeff > 0:
            z = z_loss_partial(logits, coeff=c.z_loss_coeff, **common)
        if counting:
            with torch.no_grad():
                counts = routing_map.sum(0).float()
                if self.expert_bias is not None:
                    self.local_tokens_per_expert += counts
                self.stats[0] += 0.0 if aux is None else aux.detach()
                self.stats[1] += 0.0 if z is None else z.detach()
                self.stats[2] += 1.0
                self.stats[3:] += counts
        if c.expert_capacity_factor is not None:
            routing_map = self._drop(probs_full, routing_map)
            probs_full = probs_full * routing_map
        for loss in (aux, z):
            if loss is not None:
                probs_full = attach_aux_loss(probs_full, loss, self.aux_loss_scale)
        return probs_full, routing_map


def routers_of(model: nn.Module | list[nn.Module]) -> list[TopKRouter]:
    chunks = model if isinstance(model, (list, tuple)) else [model]
    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, TopKRouter)]


def set_aux_loss_scale(model: nn.Module | list[nn.Module], scale) -> None:
    """At the start of a step (before its first forward): every router of ``model`` (a module or
    list of chunks) scales its aux losses' grads by ``scale`` = loss scale / number of
    micro-batches (what the schedule applies to the lm loss), and the ``global_aux_loss`` counts
    of the previous step are dropped (Megatron restarts them each global batch)."""
    for router in routers_of(model):
        router.aux_loss_scale = scale
        if router.global_tokens_per_expert is not None:
            router.global_tokens_per_expert.zero_()
            router.global_micro_steps.zero_()


@torch.no_grad()
def update_expert_bias(model: nn.Module | list[nn.Module], group) -> None:
    """After the optimizer step: each router with an expert bias adds ``rate * sign(mean - load)``
    where load = tokens routed to each expert over the step, summed over ``group`` (tp x dp x cp:
    the whole global batch); the counts restart. One all-reduce for all routers."""
    routers = [r for r in routers_of(model) if r.expert_bias is not None]
    if not routers:
        return
    counts = torch.stack([r.local_tokens_per_expert for r in routers])  # [layers, E]
    if group_size(group) > 1:
        all_reduce_tensor(counts, group, what="expert token counts")
    for r, load in zip(routers, counts):
        r.expert_bias += r.config.router_bias_update_rate * torch.sign(load.mean() - load)
        r.local_tokens_per_expert.zero_()

"""Load-balancing losses of the router, and how they join the backward pass.

The invariant (DESIGN.md §8): the gradient equals the single-device gradient of the global batch's
loss, auxiliary losses included, whatever TP, CP, EP, DP, PP and micro-batching. The statistics of
a loss are those of one micro-batch (all its tokens, Megatron's ``aux_loss``) or of each sequence
(``seq_aux_loss``); a micro-batch's tokens are spread over the ``seq_group`` (tp x cp), so the
token counts are summed over it. Each rank then adds only its own tokens' share of the loss
(``partial``): summed over the seq group it is the micro-batch's loss. Two conventions of the
rest of megalite fix the remaining factors:

- the router's weight sees only this rank's tokens, so it is marked ``sequence_parallel`` and its
  grad is summed over TP (like a norm weight under sequence parallel);
- grads are averaged over dp x cp, which makes each CP rank's loss count ``cp`` times its share
  (the lm loss of a CP rank is the mean over its own tokens): the partials are multiplied by
  ``cp_size``.

``global_aux_loss`` (Megatron's) takes ``f_i`` from the whole data-parallel micro-step instead:
the counts summed over tp x cp x dp (every rank's micro-batch of this micro-step, i.e. the
``micro_batch_size x dp`` consecutive samples the sampler hands out together), and averaged over
the micro-steps of the step so far (micro-step j uses the mean of micro-steps 1..j; restarted
each step by ``set_aux_loss_scale``). The loss of micro-step j is then one number for all dp x cp
ranks, so each rank's part is multiplied by dp x cp (the grads' average divides it back).

Micro-batches and DP need nothing (``aux_loss``, ``seq_aux_loss``): the schedule divides each
micro-batch's loss by the number of micro-batches and DP averages, and ``attach_aux_loss`` gives
the aux loss the same treatment (its ``scale`` is ``loss_scale / num_microbatches``, set each step
by ``set_aux_loss_scale``).
"""

from __future__ import annotations

import torch

from megalite.core.groups import all_reduce_tensor, group_size


def sum_over(x: torch.Tensor, group) -> torch.Tensor:
    """Sum ``x`` over ``group`` (no autograd; a copy)."""
    x = x.detach().clone()
    if group_size(group) > 1:
        all_reduce_tensor(x, group, what="aux-loss sum")
    return x


def aux_loss_partial(
    scores: torch.Tensor,
    routing_map: torch.Tensor,
    *,
    topk: int,
    coeff: float,
    seq_group,
    cp_size: int,
) -> torch.Tensor:
    """Megatron's switch loss ``coeff * E * sum_i f_i P_i`` of the micro-batch, this rank's part.

    ``scores`` # [T, E] fp32: every expert's routing score of this rank's T tokens (softmax, or
    normalised sigmoid); ``routing_map`` # [T, E] bool: the top-k choice (before any drop).
    ``f_i`` = tokens routed to i / (k * tokens), ``P_i`` = mean score of i, both over the
    micro-batch; the part is ``coeff * E * sum_i f_i * (sum of this rank's scores / tokens)``.
    """
    num_tokens, num_experts = scores.shape
    total = num_tokens * group_size(seq_group)
    counts = sum_over(routing_map.sum(0).float(), seq_group)  # [E]
    f = counts / (topk * total)
    return coeff * num_experts * cp_size * (f * scores.sum(0) / total).sum()


def seq_aux_loss_partial(
    scores: torch.Tensor,
    routing_map: torch.Tensor,
    *,
    batch_size: int,
    topk: int,
    coeff: float,
    seq_group,
    cp_size: int,
) -> torch.Tensor:
    """Megatron's ``seq_aux_loss``: the switch loss of each sequence, averaged over the
    micro-batch's ``batch_size`` sequences; this rank's part.
    Tokens are ``[s_local, b]`` flattened (s-major)."""
    num_tokens, num_experts = scores.shape
    s_local = num_tokens // batch_size
    s_total = s_local * group_size(seq_group)
    counts = routing_map.view(s_local, batch_size, num_experts).sum(0).float()  # [b, E]
    f = sum_over(counts, seq_group) * num_experts / (topk * s_total)
    p = scores.view(s_local, batch_size, num_experts).sum(0) / s_total  # [b, E], this rank's part
    return coeff * cp_size * (f * p).sum(1).mean()


def global_aux_loss_partial(
    scores: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    *,
    total_tokens: int,
    topk: int,
    coeff: float,
    grad_share: int,
) -> torch.Tensor:
    """Megatron's ``global_aux_loss``: the switch loss with ``f_i`` from ``tokens_per_expert``
    (the counts of the whole data-parallel micro-step, tp x cp x dp, averaged over the step's
    micro-steps so far: ``GlobalAuxLossTracker``) and ``P_i`` over the micro-step's
    ``total_tokens``; this rank's part. ``grad_share`` = dp x cp: the data-parallel layer averages
    the grads over dp x cp while the loss is one for all of them (the parts sum to it)."""
    num_experts = scores.shape[1]
    f = tokens_per_expert / (topk * total_tokens)
    return coeff * num_experts * grad_share * (f * scores.sum(0) / total_tokens).sum()


def z_loss_partial(logits: torch.Tensor, *, coeff: float, seq_group, cp_size: int) -> torch.Tensor:
    """ST-MoE's router z-loss ``coeff * mean_t logsumexp(logits_t)^2`` over the micro-batch; this
    rank's part. ``logits`` # [T, E] fp32."""
    total = logits.shape[0] * group_size(seq_group)
    return coeff * cp_size * torch.logsumexp(logits, dim=-1).square().sum() / total


class _AttachAuxLoss(torch.autograd.Function):
    """Forward: ``x`` unchanged. Backward: ``x``'s grad passes, and ``aux`` gets ``scale`` (the
    grad the loss would get had it been added to the micro-batch's loss)."""

    @staticmethod
    def forward(ctx, x, aux, scale):
        ctx.scale, ctx.aux_shape = scale, aux.shape
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        scale = ctx.scale
        if isinstance(scale, torch.Tensor):
            scale = scale.to(device=dy.device, dtype=torch.float32)
        aux_grad = torch.ones(ctx.aux_shape, dtype=torch.float32, device=dy.device) * scale
        return dy, aux_grad, None


def attach_aux_loss(x: torch.Tensor, aux: torch.Tensor, scale) -> torch.Tensor:
    """``x`` with ``aux`` joined to its backward at ``scale`` (float or 0-d tensor)."""
    return _AttachAuxLoss.apply(x, aux, scale)

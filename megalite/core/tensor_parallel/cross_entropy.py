"""Cross-entropy over a vocabulary split across TP ranks, without gathering the logits.

Each rank holds logits ``[..., V_pad/tp]`` for its slice of the (padded) vocabulary. Three
all-reduces
of ``[...]``-shaped statistics (max, sum of exp, the target's logit; plus the logit sum with label
smoothing) replace a gather of ``[..., V_pad]``. Padding columns (global index >= ``vocab_size``)
are
masked to -inf, so they take no probability mass and the loss equals the unpadded model's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megalite.core.tensor_parallel.mappings import group_rank, group_size


def _all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab_size, label_smoothing):
        local_v = logits.shape[-1]
        start = group_rank(group) * local_v
        x = logits.float()
        col = torch.arange(start, start + local_v, device=logits.device)
        valid = col < vocab_size  # [V_pad/tp]
        if not bool(valid.all()):
            x = x.masked_fill(~valid, float("-inf"))
        row_max = _all_reduce(x.amax(dim=-1), group, dist.ReduceOp.MAX)  # [...]
        x = x - row_max.unsqueeze(-1)
        exp = x.exp()
        sum_exp = _all_reduce(exp.sum(dim=-1), group)  # [...]

        in_range = (target >= start) & (target < start + local_v)
        local_target = (target - start).masked_fill(~in_range, 0)
        target_logit = x.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        target_logit = _all_reduce(target_logit.masked_fill(~in_range, 0.0), group)

        log_z = sum_exp.log()
        loss = log_z - target_logit
        if label_smoothing > 0:
            logit_sum = _all_reduce(x.masked_fill(~valid, 0.0).sum(dim=-1), group)
            smooth = log_z - logit_sum / vocab_size  # mean over the real vocabulary of -log p
            loss = (1.0 - label_smoothing) * loss + label_smoothing * smooth

        softmax = exp.div_(sum_exp.unsqueeze(-1))  # reuse the buffer: [..., V_pad/tp]
        ctx.save_for_backward(softmax, local_target, in_range, valid)
        ctx.label_smoothing, ctx.vocab_size, ctx.dtype = label_smoothing, vocab_size, logits.dtype
        return loss

    @staticmethod
    def backward(ctx, dloss):
        softmax, local_target, in_range, valid = ctx.saved_tensors
        ls = ctx.label_smoothing
        # d loss / d logits = softmax - (1 - ls) * onehot(target) - ls * valid / V
        grad = softmax
        onehot_scale = (1.0 - ls) * in_range.to(grad.dtype)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -onehot_scale.unsqueeze(-1))
        if ls > 0:
            grad.sub_(valid.to(grad.dtype) * (ls / ctx.vocab_size))
        grad.mul_(dloss.unsqueeze(-1))
        return grad.to(ctx.dtype), None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    tp_group,
    vocab_size: int | None = None,
    label_smoothing: float = 0.0,
    loss_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token loss ``[...]`` (fp32) of logits ``[..., V_pad/tp]`` against target ids ``[...]``.

    ``vocab_size`` is the real (unpadded) vocabulary; columns at or past it are ignored. Label
    smoothing follows ``torch.nn.functional.cross_entropy`` over the real vocabulary. ``loss_mask``
    (same shape as target) multiplies the per-token losses.
    """
    padded = logits.shape[-1] * group_size(tp_group)
    vocab_size = padded if vocab_size is None else vocab_size
    if not 0 < vocab_size <= padded:
        raise ValueError(f"vocab_size {vocab_size} must be in [1, padded vocabulary {padded}]")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    loss = _VocabParallelCrossEntropy.apply(logits, target, tp_group, vocab_size, label_smoothing)
    if loss_mask is not None:
        loss = loss * loss_mask
    return loss

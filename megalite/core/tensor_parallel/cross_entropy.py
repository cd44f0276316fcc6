"""Cross-entropy over a vocabulary split across TP ranks, without gathering the logits.

Each rank holds logits ``[..., V_pad/tp]`` for its slice of the (padded) vocabulary. Three
all-reduces of ``[...]``-shaped statistics (max, sum of exp, the target's logit; plus the logit sum
with label smoothing) replace a gather of ``[..., V_pad]``. Padding columns (global index >=
``vocab_size``) are masked to -inf, so they take no probability mass and the loss equals the
unpadded model's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megalite.core.groups import all_reduce_tensor, group_rank, group_size


def _all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group_size(group) > 1:
        all_reduce_tensor(x, group, op=op, what="cross-entropy")
    return x


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab_size, label_smoothing):
        local_v = logits.shape[-1]
        start = group_rank(group) * local_v
        # the real vocabulary is a prefix of every rank's slice: columns [0, n) here, padding after
        n = max(0, min(local_v, vocab_size - start))
        x = logits.float()  # [..., V_pad/tp]; no copy when already fp32 (it is never written)
        if n > 0:
            local_max = x[..., :n].amax(dim=-1)
        else:  # a rank holding only padding
            local_max = torch.full(x.shape[:-1], float("-inf"), device=x.device)
        row_max = _all_reduce(local_max, group, dist.ReduceOp.MAX)  # [...]

        in_range = (target >= start) & (target < start + local_v)
        local_target = (target - start).masked_fill(~in_range, 0)
        target_logit = x.gather(-1, local_target.unsqueeze(-1)).squeeze(-1) - row_max
        target_logit = _all_reduce(target_logit.masked_fill(~in_range, 0.0), group)
        logit_sum = None
        if label_smoothing > 0:  # sum over the real vocabulary of (x - max)
            logit_sum = _all_reduce(x[..., :n].sum(dim=-1) - n * row_max, group)

        # the one logits-sized buffer this function allocates: exp(x - max), then the softmax
        probs = x - row_max.unsqueeze(-1)
        probs.exp_()
        probs[..., n:] = 0.0  # padding takes no probability mass
        sum_exp = _all_reduce(probs.sum(dim=-1), group)  # [...]

        log_z = sum_exp.log()
        loss = log_z - target_logit
        if label_smoothing > 0:
            smooth = log_z - logit_sum / vocab_size  # mean over the real vocabulary of -log p
            loss = (1.0 - label_smoothing) * loss + label_smoothing * smooth

        softmax = probs.div_(sum_exp.unsqueeze(-1))  # [..., V_pad/tp]
        valid = torch.arange(local_v, device=logits.device) < n  # [V_pad/tp]
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

"""One training iteration: forward-backward over the micro-batches, grad sync, optimizer step.

    result = train_step(forward_step_func, [data_iterator], [chunk], optimizer, scheduler, ps=ps,
                        num_microbatches=n, forward_backward_func=get_forward_backward_func(ps))

``model`` is the list of this rank's model chunks (``ModelChunk``: each chunk's module and its
data-parallel wrapper, which the chunks of a rank share) and ``data_iterator`` one iterator per
chunk. Global batch =
``micro_batch_size x num_microbatches x dp_size``. The reported losses are the mean over this
rank's micro-batches, averaged over the DP group: equal to the mean over all micro-batches of the
global batch (last stage; empty elsewhere).
The LR schedule advances only when the optimizer actually stepped (an fp16 overflow skips both).
Nothing here reads the device: losses, grad norm and zero count stay tensors (the fp16 skip
decision inside ``optimizer.step()`` is the only host sync, and only with a loss scaler).

``calculate_per_token_loss`` (Megatron's ``--calculate-per-token-loss``): each
micro-batch's loss is its token SUM (``forward_step.masked_sum_loss``); after the grad sync the
global count N of unmasked tokens (summed on the last stage over micro-batches and ``dp x cp``,
then broadcast over the pipeline) rescales the grad buffers by ``m * dp * cp / N``, undoing the
schedule's ``1/m`` and the data-parallel average: the grads are those of the global batch's
token-weighted mean loss, whatever the layout, and ``lm loss`` reports that mean.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from megalite.core.groups import all_reduce_tensor, broadcast_tensor, group_size
from megalite.core.optimizer import MixedPrecisionOptimizer
from megalite.core.parallel_state import ParallelState
from megalite.training.forward_step import NUM_TOKENS
from megalite.training.lr_scheduler import LRScheduler
from megalite.training.model_chunks import grad_wrappers


@dataclass
class StepResult:
    losses: dict[str, torch.Tensor]  # name -> 0-d fp32 tensor (DP-averaged); empty off last stage
    update_successful: bool
    grad_norm: torch.Tensor | None  # fp32 0-d; None when the step was skipped
    num_zeros_in_grad: torch.Tensor | None  # int64 0-d; None unless counted
    learning_rate: float  # the rate this step used


def average_losses_across_dp(
    reported: list[dict[str, torch.Tensor]], dp_group
) -> dict[str, torch.Tensor]:
    """Mean over micro-batches of each name, then the mean over the DP group (one all-reduce).
    Per-token losses (the dicts carry ``NUM_TOKENS``): each name's sum over micro-batches and DP
    divided by the summed token count."""
    if not reported:
        return {}
    if NUM_TOKENS in reported[0]:
        return token_weighted_losses(reported, dp_group)[0]
    names = list(reported[0])
    stacked = torch.stack(
        [torch.stack([r[n].float().reshape(()) for r in reported]).mean() for n in names]
    )  # [num_names]
    dp = group_size(dp_group)
    if dp > 1:
        all_reduce_tensor(stacked, dp_group, what="losses")
        stacked = stacked / dp
    return dict(zip(names, stacked.unbind(0)))


def token_weighted_losses(
    reported: list[dict[str, torch.Tensor]], dp_group
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(each name's sum over micro-batches and the DP group / the summed ``NUM_TOKENS``, that
    token count # 0-d fp32): one all-reduce."""
    names = [n for n in reported[0] if n != NUM_TOKENS] + [NUM_TOKENS]
    sums = torch.stack(
        [torch.stack([r[n].float().reshape(()) for r in reported]).sum() for n in names]
    )  # [num_names]
    if group_size(dp_group) > 1:
        all_reduce_tensor(sums, dp_group, what="losses and tokens")
    tokens = sums[-1]
    means = sums[:-1] / tokens.clamp(min=1.0)
    return dict(zip(names[:-1], means.unbind(0))), tokens


def scale_grads_per_token(
    wrappers: list[nn.Module],
    reported: list[dict[str, torch.Tensor]],
    *,
    ps: ParallelState,
    num_microbatches: int,
) -> dict[str, torch.Tensor]:
    """Per-token loss: rescale every synced grad buffer by ``m * dp * cp / N`` (module docstring);
    returns the token-weighted losses on the last stage ({} elsewhere). Collective over
    ``dp x cp`` (last stage) and the pipeline group."""
    losses, tokens = {}, torch.zeros((), dtype=torch.float32, device=ps.device)
    if ps.is_last_stage:
        losses, tokens = token_weighted_losses(reported, ps.group("dp", "cp"))
    if ps.pp_size > 1:  # the count lives on the last stage
        tokens = tokens.clone()
        broadcast_tensor(tokens, ps.pp_ranks[-1], ps.pp_group, what="token count")
    scale = num_microbatches * ps.size("dp", "cp") / tokens.clamp(min=1.0)
    for wrapper in wrappers:
        for buffer in wrapper.grad_buffers:
            buffer.data.mul_(scale.to(buffer.data.dtype))
    return losses


def train_step(
    forward_step_func: Callable,
    data_iterator: list[Iterator | None],
    model: list[nn.Module],
    optimizer: MixedPrecisionOptimizer,
    scheduler: LRScheduler,
    *,
    ps: ParallelState,
    num_microbatches: int,
    forward_backward_func: Callable[..., list[dict]],
    calculate_per_token_loss: bool = False,
    before_optimizer_step: Callable[[], None] | None = None,
) -> StepResult:
    """``before_optimizer_step``: called once the grads are synced, before the optimizer changes
    any parameter or state (an asynchronous save's copy, running beside forward and backward,
    must be done by then)."""
    wrappers = grad_wrappers(model)  # chunks of a rank may share one wrapper
    for wrapper in wrappers:
        wrapper.zero_grad_buffer()
    optimizer.zero_grad()
    reported = forward_backward_func(
        forward_step_func=forward_step_func,
        data_iterator=data_iterator,
        model=model,
        num_microbatches=num_microbatches,
        forward_only=False,
        grad_scale_func=optimizer.scale_loss if optimizer.loss_scaler is not None else None,
    )
    for wrapper in wrappers:
        wrapper.finish_grad_sync()
    per_token = None
    if calculate_per_token_loss:  # grads of the global batch's token-weighted mean
        per_token = scale_grads_per_token(
            wrappers, reported, ps=ps, num_microbatches=num_microbatches
        )
    if before_optimizer_step is not None:
        before_optimizer_step()
    learning_rate = optimizer.param_groups[0]["lr"]
    update_successful, grad_norm, num_zeros = optimizer.step()
    if update_successful:
        scheduler.step()
    dp_group = ps.group("dp", "cp")
    if per_token is not None:
        losses = per_token
    else:
        losses = average_losses_across_dp(reported, dp_group) if ps.is_last_stage else {}
    return StepResult(losses, update_successful, grad_norm, num_zeros, learning_rate)

"""Forward-backward schedules over micro-batches.

All schedules share one contract, so the training loop calls whichever the layout needs:

    losses = schedule(forward_step_func=..., data_iterator=..., model=..., num_microbatches=...,
                      forward_only=False, ...)

``forward_step_func(data_iterator, model) -> (output, loss_func)``: runs the model on the next
micro-batch; on the last stage ``loss_func(output) -> (loss, {name: detached value})`` reduces the
per-token output to a scalar. The schedule divides each micro-batch's loss by ``num_microbatches``
before backward, so the grads accumulated over a step are those of the mean loss. It returns the
list
of per-micro-batch ``{name: value}`` dicts on the last stage (empty elsewhere).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch


def forward_backward_no_pipelining(
    *,
    forward_step_func: Callable,
    data_iterator: Iterator | None,
    model: torch.nn.Module,
    num_microbatches: int,
    forward_only: bool = False,
    grad_scale_func: Callable[[torch.Tensor], torch.Tensor] | None = None,
    **_unused,
) -> list[dict]:
    """One stage holds the whole model: forward and backward each micro-batch in turn, the grads
    accumulating. ``grad_scale_func`` (the fp16 loss scaler) scales the loss before backward."""
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    losses = []
    grad_ctx = torch.no_grad() if forward_only else contextlib.nullcontext()
    for _ in range(num_microbatches):
        with grad_ctx:
            output, loss_func = forward_step_func(data_iterator, model)
            loss, reported = loss_func(output)
        losses.append(reported)
        if not forward_only:
            loss = loss / num_microbatches
            if grad_scale_func is not None:
                loss = grad_scale_func(loss)
            loss.backward()
    return losses

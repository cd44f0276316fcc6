"""Evaluation: ``eval_iters`` global batches forward only, losses averaged over batches and DP.

Logged on the last stage as Megatron-LM does::

    validation loss at iteration N | lm loss value: 4.123456E+00 | lm loss PPL: 6.173497E+01 |
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import torch

from megalite.core.parallel_state import ParallelState
from megalite.training.logging import format_validation_line
from megalite.training.tensorboard import TensorBoardLogger
from megalite.training.train_step import average_losses_across_dp

logger = logging.getLogger(__name__)


def evaluate(
    forward_step_func: Callable,
    data_iterator: list[Iterator],
    model: list[torch.nn.Module],
    *,
    ps: ParallelState,
    eval_iters: int,
    num_microbatches: int,
    forward_backward_func: Callable[..., list[dict]],
) -> dict[str, float]:
    """Mean loss per name over ``eval_iters`` global batches (dropout off); {} off the last
    stage."""
    was_training = [chunk.module.training for chunk in model]
    for chunk in model:
        chunk.module.eval()
    totals: dict[str, torch.Tensor] = {}
    try:
        with torch.no_grad():
            for _ in range(eval_iters):
                reported = forward_backward_func(
                    forward_step_func=forward_step_func,
                    data_iterator=data_iterator,
                    model=model,
                    num_microbatches=num_microbatches,
                    forward_only=True,
                )
                if ps.is_last_stage:
                    mean = average_losses_across_dp(reported, ps.group("dp", "cp"))
                    for name, value in mean.items():
                        totals[name] = totals.get(name, 0.0) + value
    finally:
        for chunk, mode in zip(model, was_training):
            chunk.module.train(mode)
    return {name: float(value) / eval_iters for name, value in totals.items()}


def evaluate_and_log(
    forward_step_func: Callable,
    data_iterator: list[Iterator],
    model: list[torch.nn.Module],
    *,
    label: str,
    iteration: int,
    tensorboard: TensorBoardLogger | None = None,
    **evaluate_kwargs,
) -> dict[str, float]:
    """``evaluate`` then the Megatron-shaped line; ``label`` is e.g. "iteration 100" or
    "iteration 100 on test set". TensorBoard gets ``{name} validation`` and its ``ppl``."""
    losses = evaluate(forward_step_func, data_iterator, model, **evaluate_kwargs)
    if losses:
        logger.info(format_validation_line(label, losses))
        if tensorboard is not None:
            split = "test" if "test" in label else "validation"
            for name, value in losses.items():
                ppl = torch.tensor(min(20.0, value)).exp().item()
                tensorboard.scalars(
                    {f"{name} {split}": value, f"{name} {split} ppl": ppl}, iteration
                )
    return losses

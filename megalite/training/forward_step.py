"""The GPT forward step and its loss: what the schedule calls once per micro-batch.

Loss of a micro-batch: ``sum(loss * loss_mask) / sum(loss_mask)`` over its tokens (per-token losses
from ``GPTModel``); the step's loss is the mean over micro-batches (the schedule divides by
``num_microbatches``), as Megatron-LM's default.

Context parallelism (``cp_size`` > 1): every cp rank of a data-parallel replica reads the same
micro-batch and keeps its two chunks of the tokens, labels, loss mask and positions
(``core.context_parallel.chunking``). Its loss is ``cp_size * sum(local loss * local mask) /
sum(full mask)``: the data-parallel layer averages grads over ``dp x cp`` ranks, and the losses
reported over ``dp x cp`` are averaged too, so both come out as the single process's mean over
every token of the sequence (the cp ranks' terms sum to it; the ``cp_size`` factor undoes the
average's division).
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial

import torch
from torch import nn

from megalite.core.context_parallel.chunking import split_for_cp


def masked_mean_loss(
    loss_mask: torch.Tensor,
    output: torch.Tensor,
    *,
    num_tokens: torch.Tensor | None = None,
    cp_size: int = 1,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``output``: per-token loss # [b, s] fp32 (``s/cp`` tokens under context parallel);
    ``loss_mask`` the same shape. ``num_tokens``: the unmasked tokens of the whole micro-batch
    (default: this mask's). Returns the scalar loss and ``{"lm loss": detached}`` (a micro-batch
    with no unmasked token has loss 0)."""
    mask = loss_mask.reshape(-1).to(torch.float32)
    total = mask.sum() if num_tokens is None else num_tokens.to(torch.float32)
    loss = (output.reshape(-1).float() * mask).sum() / total.clamp(min=1.0)
    if cp_size > 1:
        loss = loss * cp_size
    return loss, {"lm loss": loss.detach()}


def cp_coordinates(model: nn.Module) -> tuple[int, int]:
    """(cp_size, cp_rank) of a GPTModel stage, or of the one a data-parallel wrapper holds."""
    inner = getattr(model, "module", model)
    return getattr(inner, "cp_size", 1), getattr(inner, "cp_rank", 0)


def gpt_forward_step(
    data_iterator: Iterator[dict] | None, model: nn.Module, *, device: torch.device
) -> tuple[torch.Tensor, partial]:
    """Read the next micro-batch dict (``tokens``, ``labels``, ``loss_mask``, ``position_ids``, all
    # [b, s]), keep this cp rank's chunks (the model's mesh says which), and run the model;
    returns (per-token loss # [b, s/cp], loss function)."""
    cp_size, cp_rank = cp_coordinates(model)
    batch = next(data_iterator)
    loss_mask = batch["loss_mask"].to(device, non_blocking=True)
    num_tokens = loss_mask.sum() if cp_size > 1 else None  # over the whole sequence

    def local(name: str) -> torch.Tensor:  # [b, s] -> [b, s/cp]
        return split_for_cp(batch[name].to(device, non_blocking=True), 1, cp_size, cp_rank)

    tokens, labels, position_ids = local("tokens"), local("labels"), local("position_ids")
    loss_mask = split_for_cp(loss_mask, 1, cp_size, cp_rank)
    output = model(tokens, position_ids, labels=labels)
    return output, partial(masked_mean_loss, loss_mask, num_tokens=num_tokens, cp_size=cp_size)


def make_forward_step(device: torch.device) -> partial:
    """``forward_step_func(data_iterator, model)`` for the schedule, on ``device``."""
    return partial(gpt_forward_step, device=device)

"""The GPT forward step and its loss: what the schedule calls once per micro-batch.

Loss of a micro-batch: ``sum(loss * loss_mask) / sum(loss_mask)`` over its tokens (per-token losses
from ``GPTModel``); the step's loss is the mean over micro-batches (the schedule divides by
``num_microbatches``), as Megatron-LM's default.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial

import torch
from torch import nn


def masked_mean_loss(
    loss_mask: torch.Tensor, output: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``output``: per-token loss # [b, s] fp32; ``loss_mask`` # [b, s] float. Returns the scalar
    loss and ``{"lm loss": detached}`` (a micro-batch with no unmasked token has loss 0)."""
    mask = loss_mask.reshape(-1).to(torch.float32)
    loss = (output.reshape(-1).float() * mask).sum() / mask.sum().clamp(min=1.0)
    return loss, {"lm loss": loss.detach()}


def gpt_forward_step(
    data_iterator: Iterator[dict] | None, model: nn.Module, *, device: torch.device
) -> tuple[torch.Tensor, partial]:
    """Read the next micro-batch dict (``tokens``, ``labels``, ``loss_mask``, ``position_ids``, all
    # [b, s]) and run the model; returns (per-token loss # [b, s], loss function)."""
    batch = next(data_iterator)
    tokens = batch["tokens"].to(device, non_blocking=True)
    labels = batch["labels"].to(device, non_blocking=True)
    position_ids = batch["position_ids"].to(device, non_blocking=True)
    loss_mask = batch["loss_mask"].to(device, non_blocking=True)
    output = model(tokens, position_ids, labels=labels)
    return output, partial(masked_mean_loss, loss_mask)


def make_forward_step(device: torch.device) -> partial:
    """``forward_step_func(data_iterator, model)`` for the schedule, on ``device``."""
    return partial(gpt_forward_step, device=device)

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

``--calculate-per-token-loss`` (Megatron's semantics): a micro-batch's loss is the SUM
of its (local) unmasked per-token losses and it also reports its token count (``NUM_TOKENS``);
``train_step`` then scales the synced grads so that they are those of ``sum / N`` with N the
unmasked tokens of the whole global batch (every micro-batch, DP and CP rank), and reports the
loss as that token-weighted mean.

``--reset-attention-mask``: a batch with ``document_ids`` # [b, s] (the loader's) or a
Megatron ``attention_mask`` # [b, 1, s, s] (True = masked) gives the model a bool mask that keeps
attention inside each document.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial

import torch

from megalite.core.context_parallel.chunking import split_for_cp
from megalite.data.gpt_dataset import document_attention_mask
from megalite.models.gpt import GPTModel

NUM_TOKENS = "num tokens"  # the reported token count of a per-token-loss micro-batch


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


def masked_sum_loss(
    loss_mask: torch.Tensor, output: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``--calculate-per-token-loss``: ``sum(loss * loss_mask)`` over this rank's tokens, and
    ``{"lm loss": that sum, NUM_TOKENS: sum(loss_mask)}`` (both detached, fp32)."""
    mask = loss_mask.reshape(-1).to(torch.float32)
    loss = (output.reshape(-1).float() * mask).sum()
    return loss, {"lm loss": loss.detach(), NUM_TOKENS: mask.sum().detach()}


def batch_attention_mask(batch: dict, device: torch.device) -> torch.Tensor | None:
    """The model's bool # [b, 1, s, s] document mask from ``document_ids`` or Megatron's
    ``attention_mask``; None when the batch carries neither (causal attention only)."""
    if "document_ids" in batch:
        return document_attention_mask(batch["document_ids"].to(device, non_blocking=True))
    if "attention_mask" in batch:
        return batch["attention_mask"].to(device, non_blocking=True).bool()
    return None


def gpt_forward_step(
    data_iterator: Iterator[dict] | None,
    model: GPTModel,
    *,
    device: torch.device,
    calculate_per_token_loss: bool = False,
) -> tuple[torch.Tensor, partial]:
    """Read the next micro-batch dict (``tokens``, ``labels``, ``loss_mask``, ``position_ids``, all
    # [b, s]), keep this cp rank's chunks (the model's mesh says which), and run the model;
    returns (per-token loss # [b, s/cp], loss function). ``model`` is the chunk's GPT stage
    (``ModelChunk.module``)."""
    cp_size, cp_rank = model.cp_size, model.cp_rank
    batch = next(data_iterator)
    loss_mask = batch["loss_mask"].to(device, non_blocking=True)
    num_tokens = loss_mask.sum() if cp_size > 1 else None  # over the whole sequence

    def local(name: str) -> torch.Tensor:  # [b, s] -> [b, s/cp]
        return split_for_cp(batch[name].to(device, non_blocking=True), 1, cp_size, cp_rank)

    tokens, labels, position_ids = local("tokens"), local("labels"), local("position_ids")
    loss_mask = split_for_cp(loss_mask, 1, cp_size, cp_rank)
    attention_mask = batch_attention_mask(batch, device)  # documents kept apart, or None
    if attention_mask is None:
        output = model(tokens, position_ids, labels=labels)
    else:  # the whole sequence's documents (each cp rank takes its chunks' boundaries)
        output = model(tokens, position_ids, labels=labels, attention_mask=attention_mask)
    if calculate_per_token_loss:  # the token sum; train_step divides by the global count
        return output, partial(masked_sum_loss, loss_mask)
    return output, partial(masked_mean_loss, loss_mask, num_tokens=num_tokens, cp_size=cp_size)


def make_forward_step(device: torch.device, *, calculate_per_token_loss: bool = False) -> partial:
    """``forward_step_func(data_iterator, model)`` for the schedule, on ``device``."""
    return partial(
        gpt_forward_step, device=device, calculate_per_token_loss=calculate_per_token_loss
    )

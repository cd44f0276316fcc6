"""This rank's GPT model chunks for a pipeline schedule, and how they share one grad wrapper.

Which layers a chunk holds follows the global stage it runs (``actions.StageLayout``):
- loop layout (1F1B, GPipe, interleaved, ZB-H1): Megatron's assignment, chunk c of rank r holds
  the ``(c * p + r)``-th block (``stages.chunk_layer_ranges``), so checkpoints carry over;
- V layout (ZBV, DualPipeV): chunk 0 of rank r is stage r, chunk 1 is stage ``2p - 1 - r``; the
  layers are cut into ``2p`` blocks in stage order (uneven first/last counts apply to stages 0
  and ``2p - 1``).
Stage 0 embeds (``pre_process``), the last stage holds the output layer and loss
(``post_process``). Tied embeddings: when both live on one rank (a V puts them on rank 0) the
output layer uses the embedding's own Parameter (``GPTModel.borrow_embedding``); otherwise the
last stage holds a copy whose grad is summed over the embedding group, as with 1F1B.

Several chunks on a rank are wrapped by one data-parallel wrapper over a ``ModelChunks`` container
(one grad buffer, one optimizer); one chunk is wrapped directly. Either way the schedule runs the
list ``schedule_chunks(wrapper)``: a ``ModelChunk`` per GPT chunk, the wrapper its grad wrapper.
The pipeline settings (chunks per rank, the schedule that runs) are read in ``pipeline_config``.
"""

from __future__ import annotations

import torch
from torch import nn

from megalite.core.distributed import DistributedDataParallel
from megalite.core.parallel_state import ParallelState
from megalite.core.pipeline_parallel.actions import StageLayout
from megalite.core.pipeline_parallel.generators import layout_of
from megalite.core.pipeline_parallel.model_chunk import ModelChunk
from megalite.core.pipeline_parallel.stages import chunk_layer_ranges
from megalite.core.tensor_parallel.random import RNGStatesTracker
from megalite.models.config import GPTConfig
from megalite.models.gpt import GPTModel


def stage_blocks(config: GPTConfig, layout: StageLayout) -> list[tuple[int, int]]:
    """``[start, end)`` layers of every global stage, stage order."""
    p, v = layout.pp_size, layout.num_chunks
    first = config.decoder_first_pipeline_num_layers if p > 1 else None
    last = config.decoder_last_pipeline_num_layers if p > 1 else None
    if layout.shape == "v":
        ranges = chunk_layer_ranges(
            config.num_layers, layout.num_stages, first_stage_layers=first, last_stage_layers=last
        )
        return [r[0] for r in ranges]
    ranges = chunk_layer_ranges(
        config.num_layers, p, num_virtual_stages=v, first_stage_layers=first, last_stage_layers=last
    )
    return [ranges[s % p][s // p] for s in range(layout.num_stages)]


def build_gpt_chunks(
    config: GPTConfig,
    ps: ParallelState,
    *,
    schedule: str = "1f1b",
    num_chunks: int = 1,
    rng_tracker: RNGStatesTracker | None = None,
    device: torch.device | None = None,
) -> list[GPTModel]:
    """This rank's chunks, chunk 0 first."""
    layout = layout_of(schedule, ps.pp_size, num_chunks)
    blocks = stage_blocks(config, layout)
    last = layout.num_stages - 1
    chunks = []
    for c in range(layout.num_chunks):
        s = layout.stage(ps.pp_rank, c)
        chunks.append(
            GPTModel(
                config,
                ps,
                pre_process=s == 0,
                post_process=s == last,
                layer_range=blocks[s],
                rng_tracker=rng_tracker,
                device=device,
            )
        )
    first_chunk = next((m for m in chunks if m.pre_process), None)
    loss_chunk = next((m for m in chunks if m.post_process), None)
    if first_chunk is not None and loss_chunk is not None and first_chunk is not loss_chunk:
        if loss_chunk.tied:
            loss_chunk.borrow_embedding(first_chunk)
    return chunks


def tied_params(chunks: list[GPTModel], ps: ParallelState) -> tuple[list, list]:
    """(params whose grads are summed over the embedding group, params not counted in the grad
    norm): the tied word embedding and its copy, when they live on different ranks."""
    shared, duplicates = [], []
    borrowed = any(m.post_process and m.tied and m.output_layer.weight is None for m in chunks)
    if ps.pp_size == 1 or borrowed:  # one Parameter on this rank (PP 1, or a V's rank 0)
        return shared, duplicates
    for m in chunks:
        w = m.shared_embedding_or_output_weight()
        if w is None:
            continue
        shared.append(w)
        if not m.pre_process:
            duplicates.append(w)
    return shared, duplicates


class ModelChunks(nn.Module):
    """The chunks of one rank as one module (for one grad wrapper and one optimizer)."""

    def __init__(self, chunks: list[nn.Module]):
        super().__init__()
        self.chunks = nn.ModuleList(chunks)

    def shared_embedding_or_output_weight(self):
        return None


def schedule_chunks(wrapper: DistributedDataParallel) -> list[ModelChunk]:
    """The list of chunks the schedule runs, chunk 0 first, each with ``wrapper`` as its grad
    wrapper: the GPT stage the wrapper holds, or each chunk of its ``ModelChunks``."""
    if isinstance(wrapper.module, ModelChunks):
        return [
            ModelChunk(module=chunk, grad_wrapper=wrapper, index=c)
            for c, chunk in enumerate(wrapper.module.chunks)
        ]
    return [ModelChunk(module=wrapper.module, grad_wrapper=wrapper)]


def grad_wrappers(model: list[ModelChunk]) -> list[DistributedDataParallel]:
    """The distinct grad wrappers behind a list of chunks (the chunks of a rank share one)."""
    out: list[DistributedDataParallel] = []
    for chunk in model:
        if chunk.grad_wrapper is not None and all(w is not chunk.grad_wrapper for w in out):
            out.append(chunk.grad_wrapper)
    return out

"""The model chunks of a rank: several per rank under virtual pipeline stages and V schedules.

A rank passes its GPT chunk modules, chunk 0 first; each holds the layers ``layer_range`` of one
global pipeline stage. ``check_chunks`` refuses what a checkpoint cannot hold; ``stage_table``
gathers every stage's layers and (pp rank, chunk) for the layout header.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from megalite.checkpoint.experts import has_experts
from megalite.checkpoint.files import CheckpointError
from megalite.core.parallel_state import ParallelState


def check_chunks(model_chunks: list[nn.Module]) -> list[nn.Module]:
    """This rank's GPT chunks, checked: at least one, holding disjoint layers; several chunks
    hold no MoE experts (their files are per pipeline rank). One-line CheckpointError."""
    chunks = list(model_chunks)
    if not chunks:
        raise CheckpointError("no model chunk on this rank: pass model_chunks=[gpt, ...]")
    ranges = sorted(tuple(m.layer_range) for m in chunks)
    if len(chunks) > 1 and (
        len({id(m) for m in chunks}) < len(chunks)
        or any(a[1] > b[0] for a, b in zip(ranges, ranges[1:]))
    ):
        raise CheckpointError(
            f"{len(chunks)} model chunks on this rank hold overlapping layers {ranges}: each "
            "chunk of a virtual pipeline holds its own layers (pass each chunk once)"
        )
    if len(chunks) > 1 and any(has_experts(m) for m in chunks):
        raise CheckpointError(
            f"{len(chunks)} model chunks on this rank hold MoE experts: expert checkpoints are "
            "per pipeline rank; save MoE models with one chunk per rank (no virtual stages, "
            "--pipeline-schedule 1f1b, gpipe or zb-h1)"
        )
    return chunks


def stage_table(chunks: list[nn.Module], ps: ParallelState) -> tuple[list, list]:
    """(layers of every global stage in stage order, (pp rank, chunk) of each): this rank's
    chunks gathered over ``ps.group("pp")``; stages are ordered by their first layer (every
    stage holds at least one layer, and stage order is layer order in every layout)."""
    mine = [(tuple(m.layer_range), ps.pp_rank, c) for c, m in enumerate(chunks)]
    every = [mine]
    if ps.pp_size > 1 and dist.is_initialized():
        every = [None] * ps.pp_size
        dist.all_gather_object(every, mine, group=ps.group("pp"))
    stages = sorted(x for rank in every for x in rank)
    return [r for r, _, _ in stages], [(p, c) for _, p, c in stages]

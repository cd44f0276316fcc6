"""The one place the training loop gets its forward-backward schedule from.

Every schedule follows the contract of ``megalite.core.pipeline_parallel.schedules`` (keyword
arguments ``forward_step_func``, ``data_iterator`` (one per model chunk), ``model`` (the list of
model chunks), ``num_microbatches``, ``forward_only``, ``grad_scale_func``, ``seq_length``,
``micro_batch_size``; returns the per-micro-batch loss dicts on the last stage; runs every backward
but the last inside the chunks' ``no_sync()``), so ``pretrain`` never branches on the layout.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from megalite.core.parallel_state import ParallelState
from megalite.core.pipeline_parallel.generators import SCHEDULES
from megalite.core.pipeline_parallel.p2p import P2PCommunicator
from megalite.core.pipeline_parallel.schedules import (
    forward_backward_no_pipelining,
    forward_backward_pipelining,
)

PIPELINE_SCHEDULES = SCHEDULES


def get_forward_backward_func(
    ps: ParallelState,
    *,
    pipeline_schedule: str = "1f1b",
    num_chunks: int = 1,
    microbatch_group_size: int | None = None,
    overlap_p2p: bool = True,
    seq_length: int | None = None,
    micro_batch_size: int | None = None,
    hidden_size: int | None = None,
    sequence_parallel: bool = False,
    dtype: torch.dtype = torch.float32,
) -> Callable[..., list[dict]]:
    """The schedule for this layout: no pipelining on one stage; otherwise ``pipeline_schedule``
    (``generators.SCHEDULES``) over ``num_chunks`` chunks per rank, with one ``P2PCommunicator``
    for the run. Activations between stages are ``[s, b, h]``, or
    ``[s/tp, b, h]`` under sequence parallel, in the model's dtype."""
    if ps.pp_size == 1:
        return forward_backward_no_pipelining
    if pipeline_schedule not in PIPELINE_SCHEDULES:
        raise ValueError(
            f"pipeline_schedule must be one of {sorted(PIPELINE_SCHEDULES)}, "
            f"got {pipeline_schedule!r}"
        )
    if None in (seq_length, micro_batch_size, hidden_size):
        raise ValueError("a pipeline schedule needs seq_length, micro_batch_size and hidden_size")
    s = seq_length // ps.tp_size if sequence_parallel else seq_length
    p2p = P2PCommunicator(
        prev_rank=ps.prev_rank,
        next_rank=ps.next_rank,
        tensor_shape=(s, micro_batch_size, hidden_size),
        dtype=dtype,
        device=ps.device,
        group=ps.pp_group,
        pp_ranks=ps.pp_ranks,
        overlap=overlap_p2p,
    )
    return partial(
        forward_backward_pipelining,
        schedule=pipeline_schedule,
        microbatch_group_size=microbatch_group_size,
        p2p=p2p,
        pp_rank=ps.pp_rank,
        pp_size=ps.pp_size,
    )

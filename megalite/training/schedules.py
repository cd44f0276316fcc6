"""The one place the training loop gets its forward-backward schedule from.

Every schedule follows the contract of ``megalite.core.pipeline_parallel.schedules`` (keyword
arguments ``forward_step_func``, ``data_iterator``, ``model``, ``num_microbatches``,
``forward_only``, ``grad_scale_func``, ``seq_length``, ``micro_batch_size``; returns the
per-micro-batch loss dicts on the last stage), so ``pretrain`` never branches on the layout.
"""

from __future__ import annotations

from collections.abc import Callable

from megalite.core.parallel_state import ParallelState
from megalite.core.pipeline_parallel.schedules import forward_backward_no_pipelining


def get_forward_backward_func(ps: ParallelState, **_options) -> Callable[..., list[dict]]:
    """The schedule for this layout: no pipelining on one stage; pipeline schedules (1F1B,
    interleaved) are chosen here once they exist."""
    if ps.pp_size == 1:
        return forward_backward_no_pipelining
    raise NotImplementedError(
        f"pipeline-model-parallel size {ps.pp_size}: pipeline parallelism lands in issue 4"
    )

"""The attributes megalite's layers set on their parameters, and the one place that reads them.

torch's ``Parameter`` has no fields for them, so the layers set plain attributes (as Megatron does):

    tensor_model_parallel  sharded over TP (``partition_dim``: the dim it is split along;
                           ``partition_stride``: blocks per shard, SwiGLU's ``[gate; up]``)
    sequence_parallel      replicated over TP but computed from a sequence shard: its grad is
                           summed over TP
    expert_parallel        an MoE expert's weight: replicated over the expert data-parallel
                           group, not the dense one
    distinct_tp_ranks      under a grid tensor-parallel mode (2d, 2.5d, 3d): the TP ranks that
                           hold the distinct blocks of the parameter (a range or tuple), the
                           others copies of them (2d: the first q x q for a weight, replicated
                           over depth, the first q for a bias or a norm scale; 3d: coordinate
                           0 on each sub-axis of its ``tp3d_replicated_over``)

A parameter no megalite layer built (a plain ``nn.Linear``, a test's tensor) carries none of them
and reads as False here; that is why these reads have a default.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def is_tensor_parallel(param: torch.Tensor) -> bool:
    """Sharded over TP: every TP rank holds a different part."""
    return bool(getattr(param, "tensor_model_parallel", False))


def is_sequence_parallel(param: torch.Tensor) -> bool:
    """Replicated over TP, its grad computed from this rank's sequence shard (summed over TP)."""
    return bool(getattr(param, "sequence_parallel", False))


def is_expert_param(param: torch.Tensor) -> bool:
    """An MoE expert's parameter: its grads are reduced over the expert DP group."""
    return bool(getattr(param, "expert_parallel", False))


def distinct_tp_ranks(param: torch.Tensor) -> Sequence[int] | None:
    """Under a grid mode, the TP ranks that hold its distinct blocks; None elsewhere."""
    return getattr(param, "distinct_tp_ranks", None)

"""Data-parallel grad sync over contiguous grad buffers, one wrapper per rung of the ZeRO ladder:
``DistributedDataParallel`` (``no_shard``: all-reduce), ``Zero1DataParallel`` (``optim``, ZeRO-1:
reduce-scatter into per-rank shards), ``Zero2DataParallel`` (``optim_grads``: only the grad shard
kept), ``Zero3DataParallel`` (``optim_grads_params``: params sharded, gathered per unit)."""

from __future__ import annotations

from megalite.core.distributed.data_parallel import DistributedDataParallel, all_reduce_flat
from megalite.core.distributed.grad_buffer import GradBuffer, GradBufferLayout
from megalite.core.distributed.zero1_data_parallel import Zero1DataParallel
from megalite.core.distributed.zero2_data_parallel import Zero2DataParallel
from megalite.core.distributed.zero3_data_parallel import Zero3DataParallel

__all__ = [
    "DistributedDataParallel",
    "GradBuffer",
    "GradBufferLayout",
    "Zero2DataParallel",
    "Zero3DataParallel",
    "Zero1DataParallel",
    "wrapper_class",
    "all_reduce_flat",
]


STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def wrapper_class(strategy: str) -> type[DistributedDataParallel]:
    """The wrapper of ``--data-parallel-sharding-strategy`` ``strategy``."""
    classes = dict(zip(STRATEGIES, (DistributedDataParallel, Zero1DataParallel, Zero2DataParallel,
                                    Zero3DataParallel)))  # fmt: skip
    if strategy not in classes:
        raise ValueError(f"data-parallel sharding strategy {strategy!r} is not one of {STRATEGIES}")
    return classes[strategy]

"""Data-parallel grad sync over contiguous grad buffers, one wrapper per rung of the ZeRO ladder:
``DistributedDataParallel`` (``no_shard``: all-reduce), ``Zero1DataParallel`` (``optim``, ZeRO-1:
reduce-scatter into per-rank shards), ``Zero2DataParallel`` (``optim_grads``: only the grad shard
kept), ``Zero3DataParallel`` (``optim_grads_params``: params sharded, gathered per unit; their
shards on the host or in files with ``ParamOffloadSpec``)."""

from __future__ import annotations

from megalite.core.distributed.data_parallel import DistributedDataParallel
from megalite.core.distributed.grad_buffer import GradBuffer, GradBufferLayout
from megalite.core.distributed.param_offload import ParamOffloadSpec
from megalite.core.distributed.zero1_data_parallel import Zero1DataParallel
from megalite.core.distributed.zero2_data_parallel import Zero2DataParallel
from megalite.core.distributed.zero3_data_parallel import Zero3DataParallel

__all__ = [
    "DistributedDataParallel",
    "GradBuffer",
    "GradBufferLayout",
    "ParamOffloadSpec",
    "STRATEGIES",
    "Zero1DataParallel",
    "Zero2DataParallel",
    "Zero3DataParallel",
    "wrapper_class",
]


# data_parallel_sharding_strategy: the rungs of the ladder, in order (index = ZeRO stage)
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
_WRAPPERS = (DistributedDataParallel, Zero1DataParallel, Zero2DataParallel, Zero3DataParallel)


def wrapper_class(strategy: str) -> type[DistributedDataParallel]:
    """The wrapper of sharding strategy ``strategy`` (one of ``STRATEGIES``)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"data_parallel_sharding_strategy {strategy!r} is not one of {STRATEGIES}")
    return _WRAPPERS[STRATEGIES.index(strategy)]

"""Data-parallel grad sync over contiguous grad buffers: ``DistributedDataParallel`` (all-reduce,
no sharding) and ``ZeroDataParallel`` (reduce-scatter into per-rank shards, for the ZeRO rungs)."""

from __future__ import annotations

from megalite.core.distributed.data_parallel import DistributedDataParallel, all_reduce_flat
from megalite.core.distributed.grad_buffer import GradBuffer, GradBufferLayout
from megalite.core.distributed.zero_data_parallel import ZeroDataParallel

__all__ = [
    "DistributedDataParallel",
    "GradBuffer",
    "GradBufferLayout",
    "ZeroDataParallel",
    "all_reduce_flat",
]

"""Tensor parallelism: autograd collectives, sharded layers, vocab-parallel loss, RNG states."""

from megalite.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megalite.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    padded_vocab_size,
)
from megalite.core.tensor_parallel.mappings import (
    copy_to_tp_region,
    gather_from_sp_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sp_region,
    scatter_to_sp_region,
    scatter_to_tp_region,
)
from megalite.core.tensor_parallel.random import RNGStatesTracker, checkpoint, model_parallel_seed

__all__ = [
    "ColumnParallelLinear",
    "RNGStatesTracker",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "checkpoint",
    "copy_to_tp_region",
    "gather_from_sp_region",
    "gather_from_tp_region",
    "model_parallel_seed",
    "padded_vocab_size",
    "reduce_from_tp_region",
    "reduce_scatter_to_sp_region",
    "scatter_to_sp_region",
    "scatter_to_tp_region",
    "vocab_parallel_cross_entropy",
]

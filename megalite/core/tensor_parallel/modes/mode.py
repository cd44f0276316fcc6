"""A tensor-parallel mode as one small object: the layers a model builds under it, its groups,
and how it cuts a micro-batch. A model asks ``tensor_parallel_mode(ps)`` and builds every layer
through it; 3d is ``Mode3D`` (``mode3d.py``).

    mode = tensor_parallel_mode(ps)
    mode.column_linear(h, 3 * h, ...), mode.row_linear(...)   -> modules, forward x -> (y, None)
    mode.norm("RMSNorm", h, ...), mode.embedding(V, h, ...)
    mode.output_layer(V, V_pad, h, ...), mode.cross_entropy(logits, target, ...)
    mode.batch_block(t, dim), mode.gather_batch(loss)         the micro-batch in and out
    mode.residual_block(t, dim), mode.attention_block(t, dim) of a batch_block'd tensor, the
        blocks the residual stream and attention hold (per-sample positions, attention masks)

``split_size`` is what heads, query groups, ffn and the vocabulary are split into (the TP size
under 1d, the grid side q under 2d / 2.5d); ``activation_split`` what the ``[s, b, h]``
activations between pipeline stages are cut into along b and h.
"""

from __future__ import annotations

import torch
from torch import nn

from megalite.core.groups import group_size
from megalite.core.norms import build_norm
from megalite.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megalite.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from megalite.core.tensor_parallel.mappings import gather_from_tp_region
from megalite.core.tensor_parallel.modes.grid import Grid
from megalite.core.tensor_parallel.modes.grid_layers import (
    GridEmbedding,
    GridLayerNorm,
    GridLinear,
    GridRMSNorm,
    GridVocabOutput,
    grid_cross_entropy,
)
from megalite.core.tensor_parallel.modes.mode3d import Mode3D
from megalite.core.tensor_parallel.modes.summa import replicated_param


class OneD:
    """Megatron's 1d tensor parallelism: column- then row-parallel linears over ``tp_group``,
    activations whole (or sequence-split under sequence parallel) on every TP rank."""

    name = "1d"

    def __init__(self, tp_group) -> None:
        self.tp_group = tp_group
        self.split_size = group_size(tp_group)
        self.activation_split = (1, 1)

    def column_linear(self, input_size: int, output_size: int, **kwargs) -> nn.Module:
        return ColumnParallelLinear(input_size, output_size, tp_group=self.tp_group, **kwargs)

    def row_linear(self, input_size: int, output_size: int, **kwargs) -> nn.Module:
        return RowParallelLinear(
            input_size, output_size, tp_group=self.tp_group, input_is_parallel=True, **kwargs
        )

    def norm(self, kind: str, hidden_size: int, **kwargs) -> nn.Module:
        return build_norm(kind, hidden_size, **kwargs)

    def embedding(self, num_embeddings: int, embedding_dim: int, **kwargs) -> nn.Module:
        return VocabParallelEmbedding(
            num_embeddings, embedding_dim, tp_group=self.tp_group, **kwargs
        )

    def output_layer(
        self, vocab_size: int, padded_vocab_size: int, hidden_size: int, *, init_method, **kwargs
    ) -> nn.Module:
        """The logits layer ``[s, b, h] -> ([s, b, V_pad/tp], None)``; its forward takes the tied
        word embedding as ``weight``. ``init_method`` initialises the real ``vocab_size`` rows."""
        kwargs.pop("make_vocab_size_divisible_by", None)
        return ColumnParallelLinear(
            hidden_size,
            padded_vocab_size,
            tp_group=self.tp_group,
            bias=False,
            init_method=lambda w: init_method(w[:vocab_size]),
            **kwargs,
        )

    def hidden_block(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's part of a tensor over the whole hidden dim (last): all of it."""
        return t

    def mark_hidden_block(self, param: torch.Tensor) -> None:
        """A parameter ``hidden_block`` cut: whole here, nothing to mark."""

    def replicated(self, param: torch.Tensor) -> torch.Tensor:
        """A parameter every rank of the tensor group holds whole, as the forward uses it."""
        return param

    def batch_block(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        return t

    def residual_block(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        return t

    def attention_block(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        return t

    def gather_batch(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        return t

    def cross_entropy(self, logits, target, **kwargs) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, target, tp_group=self.tp_group, **kwargs)


class GridMode:
    """2d (Optimus) and 2.5d (Tesseract) tensor parallelism on a ``Grid`` (``grid.py``): every
    activation ``[s, b/(dq), h/q]``, every linear a ``GridLinear``, the vocabulary split over the
    grid (embedding and output share one table layout, so they can be tied)."""

    def __init__(self, grid: Grid, name: str) -> None:
        self.grid, self.name = grid, name
        self.split_size = grid.q
        self.activation_split = (grid.batch_blocks, grid.q)

    def column_linear(self, input_size: int, output_size: int, **kwargs) -> nn.Module:
        _refuse_sequence_parallel(kwargs.pop("sequence_parallel", False), self.name)
        return GridLinear(input_size, output_size, grid=self.grid, **kwargs)

    def row_linear(self, input_size: int, output_size: int, **kwargs) -> nn.Module:
        return self.column_linear(input_size, output_size, **kwargs)

    def norm(
        self,
        kind: str,
        hidden_size: int,
        *,
        eps: float,
        sequence_parallel: bool = False,
        use_fused: bool = True,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
        zero_centered_gamma: bool = False,
    ) -> nn.Module:
        """The grid's norm (the PyTorch math: ``use_fused`` has no kernel to choose here)."""
        _refuse_sequence_parallel(sequence_parallel, self.name)
        if zero_centered_gamma:
            raise ValueError(f"tensor_parallel_mode {self.name} has no zero_centered_gamma norm")
        classes = {"LayerNorm": GridLayerNorm, "RMSNorm": GridRMSNorm}
        if kind not in classes:
            raise ValueError(f"normalization must be one of {sorted(classes)}, got {kind!r}")
        return classes[kind](
            hidden_size, grid=self.grid, eps=eps, params_dtype=params_dtype, device=device
        )

    def embedding(self, num_embeddings: int, embedding_dim: int, **kwargs) -> nn.Module:
        kwargs.pop("reduce_scatter_embeddings", None)
        return GridEmbedding(num_embeddings, embedding_dim, grid=self.grid, **kwargs)

    def hidden_block(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's hidden block (column ``col``) of a tensor over the whole hidden dim."""
        return t.chunk(self.grid.q, -1)[self.grid.col].contiguous()

    def mark_hidden_block(self, param: torch.Tensor) -> None:
        """A parameter ``hidden_block`` cut: distinct on the first q TP ranks (one per column)."""
        param.distinct_tp_ranks = range(self.grid.q)

    def replicated(self, param: torch.Tensor) -> torch.Tensor:
        """A parameter held by the d x q ranks of one grid column block, as the forward uses it:
        its grad is summed over them in the backward."""
        return replicated_param(param, self.grid.row_depth_group)

    def batch_block(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's batch block (``depth * q + row``) of a whole micro-batch along ``dim``."""
        return t.chunk(self.grid.batch_blocks, dim)[self.grid.batch_block]

    def residual_block(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """The batch block the residual stream holds: ``batch_block``'s (applied already)."""
        return t

    def attention_block(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """The batch block attention computes: ``batch_block``'s (applied already)."""
        return t

    def gather_batch(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """The whole micro-batch from every rank's batch block along ``dim`` (the last one):
        fwd all-gather over ``row_depth_group``, bwd this rank's block."""
        if dim not in (-1, t.dim() - 1):
            raise ValueError(f"gather_batch gathers the last dim, got dim {dim} of {t.dim()}")
        return gather_from_tp_region(t, self.grid.row_depth_group)

    def output_layer(
        self, vocab_size: int, padded_vocab_size: int, hidden_size: int, *, init_method, **kwargs
    ) -> nn.Module:
        """The logits layer ``[s, b/(dq), h/q] -> ([s, b/(dq), V_pad/q], None)`` in the word
        embedding's table layout (``GridVocabOutput``); its forward takes the tied table as
        ``weight``."""
        kwargs.pop("sequence_parallel", None)
        layer = GridVocabOutput(
            vocab_size, hidden_size, grid=self.grid, init_method=init_method, **kwargs
        )
        if layer.padded_num_embeddings != padded_vocab_size:
            raise ValueError(
                f"the grid pads the vocabulary to {layer.padded_num_embeddings}, the model to "
                f"{padded_vocab_size}"
            )
        return layer

    def cross_entropy(self, logits, target, **kwargs) -> torch.Tensor:
        return grid_cross_entropy(logits, target, grid=self.grid, **kwargs)


def _refuse_sequence_parallel(sequence_parallel: bool, mode: str) -> None:
    if sequence_parallel:
        raise ValueError(
            f"sequence_parallel does not apply under tensor_parallel_mode {mode} (the grid splits "
            "the activations itself); turn it off"
        )


def tensor_parallel_mode(ps) -> OneD | GridMode | Mode3D:
    """The mode of a ``ParallelState``'s tensor group (its ``sizes.tp_mode``)."""
    mode = ps.sizes.tp_mode
    if mode == "1d":
        return OneD(ps.tp_group)
    if mode in ("2d", "2.5d"):
        return GridMode(Grid.of(ps), mode)
    if mode == "3d":
        return Mode3D.of(ps)
    raise ValueError(f"tensor_parallel_mode must be one of 1d, 2d, 2.5d, 3d, got {mode!r}")

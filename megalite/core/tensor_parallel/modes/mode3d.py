"""3D tensor parallelism as a mode (``mode.py``'s interface), so the models build under it
unchanged: every linear a ``Linear3D``, the norms ``LayerNorm3D`` / ``RMSNorm3D``, the vocabulary
ends ``VocabEmbedding3D`` and ``VocabOutput3D`` (``layers3d.py``, ``vocab3d.py``).

The cube's groups are the mesh's sub-axes ``tp_input``, ``tp_weight``, ``tp_output``
(``mesh_layout.tp_grid_groups``). The residual stream is ``[s, b/q^2, h/q]`` in the residual
layout; a column linear (``residual`` -> ``inner``) and a row linear (``inner`` -> ``residual``)
are the same ``Linear3D`` with its input layout set. The model hands every rank the whole
micro-batch of ids and labels (``batch_block`` keeps them whole): the embedding and the
cross-entropy cut their own blocks, and ``gather_batch`` assembles the per-token loss.

The output layer holds its ``[V_pad, h]`` table in the word embedding's layout (``[V_pad/q,
h/q^2]``), so a tied output layer uses the embedding's parameter as it is, and a last pipeline
stage's copy of it is synchronised with the first stage's block for block.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megalite.core.tensor_parallel.layers import padded_vocab_size
from megalite.core.tensor_parallel.mappings import gather_from_tp_region
from megalite.core.tensor_parallel.modes.comm3d import (
    copy_to_group,
    gather_dim,
    reduce_scatter_dim,
    reduce_scatter_grad,
)
from megalite.core.tensor_parallel.modes.grid3d import SUB_AXES_3D, Groups3D, first_copy_ranks
from megalite.core.tensor_parallel.modes.layers3d import (
    BATCH_DIM,
    LayerNorm3D,
    Linear3D,
    RMSNorm3D,
)
from megalite.core.tensor_parallel.modes.vocab3d import VocabEmbedding3D, cross_entropy_3d


class ModelLinear3D(Linear3D):
    """A ``Linear3D`` with the model's linear interface: ``forward(x) -> (y, None)``."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return super().forward(x), None


class _VocabOutput3D(torch.autograd.Function):
    """Logits from a residual-layout ``x`` and a table in the embedding's layout: the 3D matmul of
    ``Linear3D`` whose weight gather runs along the table's hidden dim (``layers3d.py``)."""

    @staticmethod
    def forward(ctx, x, table, g: Groups3D):
        w = gather_dim(table, 1, g.weight_group, what="3d output table")  # [V/q, h/q]
        x_rows = gather_dim(x, BATCH_DIM, g.input_group, what="3d input")  # [s, b/q, h/q]
        y = reduce_scatter_dim(F.linear(x_rows, w), BATCH_DIM, g.output_group, what="3d output")
        ctx.save_for_backward(x_rows, table)
        ctx.g = g
        return y  # [s, b/q^2, V/q], inner layout

    @staticmethod
    def backward(ctx, dy):
        x_rows, table = ctx.saved_tensors
        g = ctx.g
        dy_rows = gather_dim(dy, BATCH_DIM, g.output_group, what="3d output grad")
        w = gather_dim(table, 1, g.weight_group, what="3d output table")
        dx = reduce_scatter_dim(dy_rows @ w, BATCH_DIM, g.input_group, what="3d input grad")
        dw = dy_rows.flatten(0, 1).t() @ x_rows.flatten(0, 1)  # [V/q, h/q]
        dtable = reduce_scatter_grad(dw, 1, g.weight_group, what="3d output table grad")
        return dx, dtable, None


class VocabOutput3D(VocabEmbedding3D):
    """The logits layer: residual-layout ``[s, b/q^2, h/q]`` -> ``([s, b/q^2, V_pad/q], None)``,
    inner layout (vocab block ``input_rank``). Its table is a ``VocabEmbedding3D``'s; ``forward``
    takes the tied word embedding's as ``weight``."""

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None):
        table = self.weight if weight is None else weight
        return _VocabOutput3D.apply(x, table, self.groups), None


class Mode3D:
    """3D tensor parallelism over the cube of one tensor group (``Groups3D``)."""

    name = "3d"

    def __init__(self, groups: Groups3D) -> None:
        self.g = groups
        self.split_size = groups.q
        self.activation_split = (groups.q * groups.q, groups.q)

    @classmethod
    def of(cls, ps) -> Mode3D:
        """The mode of a ``ParallelState`` built with ``tensor_parallel_mode`` 3d."""
        groups = {axis: ps.group(f"tp_{axis}") for axis in SUB_AXES_3D}
        return cls(Groups3D.of(groups, ps.size("tp_input"), ps.tp_rank))

    def _linear(self, input_size, output_size, layout, **kwargs) -> nn.Module:
        _refuse_sequence_parallel(kwargs.pop("sequence_parallel", False))
        return ModelLinear3D(input_size, output_size, self.g, input_layout=layout, **kwargs)

    def column_linear(self, input_size: int, output_size: int, **kwargs) -> nn.Module:
        return self._linear(input_size, output_size, "residual", **kwargs)

    def row_linear(self, input_size: int, output_size: int, **kwargs) -> nn.Module:
        return self._linear(input_size, output_size, "inner", **kwargs)

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
        """The residual layout's norm (the PyTorch math: ``use_fused`` has no kernel here)."""
        _refuse_sequence_parallel(sequence_parallel)
        if zero_centered_gamma:
            raise ValueError("tensor_parallel_mode 3d has no zero_centered_gamma norm")
        classes = {"LayerNorm": LayerNorm3D, "RMSNorm": RMSNorm3D}
        if kind not in classes:
            raise ValueError(f"normalization must be one of {sorted(classes)}, got {kind!r}")
        return classes[kind](hidden_size, self.g, eps=eps, params_dtype=params_dtype, device=device)

    def _padded(self, vocab_size: int, make_vocab_size_divisible_by: int) -> int:
        return padded_vocab_size(
            vocab_size,
            make_vocab_size_divisible_by=make_vocab_size_divisible_by,
            tp_size=self.g.q,
        )

    def embedding(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        make_vocab_size_divisible_by: int = 128,
        reduce_scatter_embeddings: bool = False,
        **kwargs,
    ) -> nn.Module:
        """Whole ids ``[s, b]`` -> ``[s, b/q^2, h/q]`` (residual layout)."""
        _refuse_sequence_parallel(reduce_scatter_embeddings)
        padded = self._padded(num_embeddings, make_vocab_size_divisible_by)
        return VocabEmbedding3D(padded, embedding_dim, self.g, init_rows=num_embeddings, **kwargs)

    def output_layer(
        self,
        vocab_size: int,
        padded_vocab_size: int,
        hidden_size: int,
        *,
        make_vocab_size_divisible_by: int = 128,
        sequence_parallel: bool = False,
        **kwargs,
    ) -> nn.Module:
        """The logits layer in the word embedding's table layout (``VocabOutput3D``)."""
        _refuse_sequence_parallel(sequence_parallel)
        padded = self._padded(vocab_size, make_vocab_size_divisible_by)
        if padded != padded_vocab_size:
            raise ValueError(
                f"3d pads the vocabulary to {padded}, the model to {padded_vocab_size}"
            )
        return VocabOutput3D(padded, hidden_size, self.g, init_rows=vocab_size, **kwargs)

    def hidden_block(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's residual-layout hidden block (``output_rank``) of a whole-hidden tensor."""
        return t.chunk(self.g.q, -1)[self.g.output_rank].contiguous()

    def mark_hidden_block(self, param: torch.Tensor) -> None:
        """A parameter ``hidden_block`` cut: replicated over the input and weight sub-axes."""
        param.tp3d_replicated_over = ("input", "weight")
        param.distinct_tp_ranks = first_copy_ranks(param.tp3d_replicated_over, self.g.q)

    def replicated(self, param: torch.Tensor) -> torch.Tensor:
        """A ``mark_hidden_block`` parameter as the forward uses it: its grad summed over the
        input and weight sub-axes, whose ranks see different batch blocks."""
        param = copy_to_group(param, self.g.input_group, what="3d replicated param")
        return copy_to_group(param, self.g.weight_group, what="3d replicated param")

    def batch_block(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """The whole micro-batch: the 3D embedding and cross-entropy cut their own blocks."""
        return t

    def residual_block(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """The residual layout's batch block (``weight_rank * q + input_rank``) of a whole t."""
        return t.chunk(self.g.q**2, dim)[self.g.batch_block("residual")]

    def attention_block(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """The inner layout's batch block (``weight_rank * q + output_rank``), where attention
        runs, of a whole t."""
        return t.chunk(self.g.q**2, dim)[self.g.batch_block("inner")]

    def gather_batch(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """The whole micro-batch along ``dim`` (the last) from the inner layout's batch blocks
        (``weight_rank * q + output_rank``): all-gathered over output then weight; backward keeps
        this rank's block."""
        if dim not in (-1, t.dim() - 1):
            raise ValueError(f"gather_batch gathers the last dim, got dim {dim} of {t.dim()}")
        return gather_from_tp_region(
            gather_from_tp_region(t, self.g.output_group), self.g.weight_group
        )

    def cross_entropy(self, logits, target, **kwargs) -> torch.Tensor:
        """Per-token loss ``[s, b/q^2]`` (inner batch block) of whole targets ``[s, b]``."""
        return cross_entropy_3d(logits, target, self.g, **kwargs)


def _refuse_sequence_parallel(sequence_parallel: bool) -> None:
    if sequence_parallel:
        raise ValueError(
            "sequence_parallel does not apply under tensor_parallel_mode 3d (the cube splits the "
            "activations itself); turn it off"
        )


def check_cube_dims(
    q: int,
    *,
    hidden_size: int,
    num_attention_heads: int,
    num_query_groups: int,
    kv_channels: int,
    ffn_hidden_size: int,
    micro_batch_size: int,
) -> None:
    """The model's dims on a q x q x q cube: heads and query groups split over q; the hidden size,
    QKV width and ffn over q^2 (a weight's rows are cut in q^2 blocks, the embedding table's hidden
    dim too); the micro-batch in q^2 blocks of whole sequences. The vocabulary is padded to a
    multiple of q. One-line ValueError naming the parameter, the numbers and the fix."""
    qkv = (num_attention_heads + 2 * num_query_groups) * kv_channels
    for name, value, by, why in (
        ("num_attention_heads", num_attention_heads, q, "q = {q} head blocks"),
        ("num_query_groups", num_query_groups, q, "q = {q} query-group blocks"),
        ("hidden_size", hidden_size, q * q, "q^2 = {by} row blocks of the output weights"),
        ("ffn_hidden_size", ffn_hidden_size, q * q, "q^2 = {by} row blocks of linear_fc1"),
        ("the QKV width (heads + 2 query groups) x kv_channels", qkv, q * q, "q^2 = {by} blocks"),
        ("micro_batch_size", micro_batch_size, q * q, "q^2 = {by} blocks of whole sequences"),
    ):
        if value % by:
            raise ValueError(
                f"{name} {value} is not divisible by {by} under tensor_parallel_mode 3d "
                f"(the cube splits it into {why.format(q=q, by=by)}); use a multiple of {by}"
            )

"""The vocabulary ends of a 3D model: the vocab-parallel embedding and the cross-entropy.

``VocabEmbedding3D`` is the product ``onehot(ids) [M, V] x E [V, h]`` done as a 3D linear taking
the inner layout, so it returns the residual layout (``layers3d.py``): the table ``E`` is held as
vocab block ``input_rank`` of q and hidden block ``output_rank * q + weight_rank`` of q^2
(``[V/q, h/q^2]``). Forward: gather ``E`` over the weight group (``[V/q, h/q]``), look up the ids
of batch block ``weight_rank`` of q that fall in this vocab block (the others give zero rows), and
reduce-scatter the partial rows over the input group (``[s, b/q^2, h/q]``). Backward: all-gather the
output grad over the input group, scatter-add it into ``[V/q, h/q]``, reduce-scatter over the weight
group. Every rank holds the whole ``[s, b]`` ids (they are small), as under 1D TP.

``PositionEmbedding3D`` holds GPT-2's learned positions as hidden block ``output_rank``
(``[P, h/q]``), replicated over the other two sub-axes (their grads summed over both).

The output layer is a ``Linear3D(h, V_pad, input_layout="residual")``: its logits are inner layout,
vocab block ``input_rank``; ``cross_entropy_3d`` runs the 1D vocab-parallel cross-entropy over the
input group on them. The padded vocabulary ``V_pad`` must divide by q^2
(``padded_vocab_size(..., tp_size=q * q)``). The embedding and the output layer hold different
blocks of ``E``, so a tied output layer would need its own copy (not done here).
"""

from __future__ import annotations

import torch
from torch import nn

from megalite.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megalite.core.tensor_parallel.init import InitMethod, default_init
from megalite.core.tensor_parallel.modes.comm3d import (
    copy_to_group,
    gather_dim,
    reduce_scatter_dim,
    reduce_scatter_grad,
)
from megalite.core.tensor_parallel.modes.grid3d import Groups3D
from megalite.core.tensor_parallel.modes.layers3d import BATCH_DIM, check_divides, mark3d


def embedding_block3d(full: torch.Tensor, g: Groups3D) -> torch.Tensor:
    """This rank's block of a full ``[V, h]`` embedding table."""
    rows = full.chunk(g.q, dim=0)[g.input_rank]
    return rows.chunk(g.q * g.q, dim=1)[g.output_rank * g.q + g.weight_rank]


class _Embedding3D(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight, g: Groups3D):
        table = gather_dim(weight, 1, g.weight_group, what="3d embedding")  # [V/q, h/q]
        local_v = table.shape[0]
        start = g.input_rank * local_v
        rows = ids.chunk(g.q, dim=BATCH_DIM)[g.weight_rank]  # [s, b/q]
        in_range = (rows >= start) & (rows < start + local_v)
        local_ids = (rows - start).masked_fill(~in_range, 0)
        partial = table[local_ids] * in_range.unsqueeze(-1)  # [s, b/q, h/q]
        ctx.save_for_backward(local_ids, in_range)
        ctx.g, ctx.table_shape = g, table.shape
        return reduce_scatter_dim(partial, BATCH_DIM, g.input_group, what="3d embedding output")

    @staticmethod
    def backward(ctx, dy):
        local_ids, in_range = ctx.saved_tensors
        g = ctx.g
        dy_rows = gather_dim(dy, BATCH_DIM, g.input_group, what="3d embedding output grad")
        dy_rows = dy_rows * in_range.unsqueeze(-1)  # [s, b/q, h/q]
        dtable = torch.zeros(ctx.table_shape, dtype=dy.dtype, device=dy.device)
        dtable.index_add_(0, local_ids.reshape(-1), dy_rows.reshape(-1, dy_rows.shape[-1]))
        dw = reduce_scatter_grad(dtable, 1, g.weight_group, what="3d embedding grad")
        return None, dw, None


class VocabEmbedding3D(nn.Module):
    """Token ids # [s, b] (whole, on every rank) -> embeddings # [s, b/q^2, h/q], residual layout.

    ``num_embeddings`` is the padded vocabulary (divisible by q); only its first ``init_rows`` rows
    are initialised from ``init_method`` (the real vocabulary; padding rows stay zero)."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        groups: Groups3D,
        *,
        init_method: InitMethod = default_init,
        init_rows: int | None = None,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
    ):
        super().__init__()
        q = groups.q
        check_divides(num_embeddings, q, what="num_embeddings (padded vocabulary)")
        check_divides(embedding_dim, q * q, what="embedding_dim")
        self.groups = groups
        full = torch.zeros(num_embeddings, embedding_dim, dtype=torch.float32)
        init_method(full if init_rows is None else full[:init_rows])
        block = embedding_block3d(full, groups)
        self.weight = mark3d(
            nn.Parameter(block.to(device=device, dtype=params_dtype).contiguous()), (), groups
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        check_divides(ids.shape[BATCH_DIM], self.groups.q**2, what="batch size")
        return _Embedding3D.apply(ids, self.weight, self.groups)


class PositionEmbedding3D(nn.Module):
    """GPT-2's learned positions: the table ``[max_positions, h]`` held as hidden block
    ``output_rank`` of q (``[P, h/q]``), replicated over the input and weight sub-axes, whose
    grads are summed over both in backward. ``forward(s)`` # [s, 1, h/q] is added to a
    residual-layout activation (the sequence is whole under 3D)."""

    def __init__(
        self,
        max_positions: int,
        hidden_size: int,
        groups: Groups3D,
        *,
        init_method: InitMethod = default_init,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
    ):
        super().__init__()
        check_divides(hidden_size, groups.q, what="hidden_size")
        self.groups = groups
        full = torch.zeros(max_positions, hidden_size, dtype=torch.float32)
        init_method(full)
        block = full.chunk(groups.q, dim=1)[groups.output_rank]
        self.weight = mark3d(
            nn.Parameter(block.to(device=device, dtype=params_dtype).contiguous()),
            ("input", "weight"),
            groups,
        )

    def forward(self, seq_length: int) -> torch.Tensor:
        table = copy_to_group(
            self.weight[:seq_length], self.groups.input_group, what="3d positions"
        )
        table = copy_to_group(table, self.groups.weight_group, what="3d positions")
        return table.unsqueeze(1)


def cross_entropy_3d(
    logits: torch.Tensor,
    target: torch.Tensor,
    groups: Groups3D,
    *,
    vocab_size: int | None = None,
    label_smoothing: float = 0.0,
    loss_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token loss # [s, b/q^2] (fp32) of inner-layout logits # [s, b/q^2, V_pad/q] against the
    whole target ids # [s, b]; ``loss_mask`` is whole too. The rows are batch block
    ``groups.batch_block("inner")``, the same on the q ranks of an input group."""
    block = groups.batch_block("inner")
    n = groups.q * groups.q
    if loss_mask is not None:
        loss_mask = loss_mask.chunk(n, dim=BATCH_DIM)[block]
    return vocab_parallel_cross_entropy(
        logits,
        target.chunk(n, dim=BATCH_DIM)[block],
        tp_group=groups.input_group,
        vocab_size=vocab_size,
        label_smoothing=label_smoothing,
        loss_mask=loss_mask,
    )

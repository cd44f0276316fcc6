"""The layers of the 2d / 2.5d grid: linear, LayerNorm and RMSNorm over a split hidden dim, the
vocab-split embedding and cross-entropy. Blocks and groups: ``grid.py``; the product: ``summa.py``.

Every layer equals its unsharded counterpart on the full weights: a weight is initialised in full
from its keyed ``init_method`` (``tensor_parallel/init.py``) and the rank keeps its block, so any
grid starts from the single-process numbers. Parameters replicated over some of the grid (a bias,
a norm's scale: one column block held by the d x q ranks of ``row_depth_group``; the embedding
over depth) enter the forward through ``replicated_param`` on that group, so their grads are
summed there (in fp32) inside the backward and every replica holds the full gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megalite.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megalite.core.tensor_parallel.init import InitMethod, default_init
from megalite.core.tensor_parallel.layers import divide, padded_vocab_size, set_tp_attributes
from megalite.core.tensor_parallel.mappings import (
    gather_first,
    reduce_scatter_to_sp_region,
)
from megalite.core.tensor_parallel.modes.grid import Grid
from megalite.core.tensor_parallel.modes.summa import (
    grid_linear,
    grid_vocab_linear,
    replicated_param,
    sum_over,
)


def _block(full: torch.Tensor, grid: Grid, *, stride: int = 1) -> torch.Tensor:
    """This rank's ``[out/q, in/q]`` block of a full ``[out, in]`` weight (or ``[out/q]`` of a
    bias): out block ``col``, in block ``row``. ``stride`` > 1: out is ``stride`` stacked blocks
    (SwiGLU's ``[gate; up]``) and the rank keeps its chunk of each, as the 1d layers do."""
    out = torch.cat([b.chunk(grid.q, 0)[grid.col] for b in full.chunk(stride, 0)], 0)
    return out if full.dim() == 1 else out.chunk(grid.q, 1)[grid.row]


def grid_parameter(
    shard: torch.Tensor, grid: Grid, *, dtype, device, sharded: bool
) -> nn.Parameter:
    """A Parameter of this rank's block: ``sharded`` over the q x q grid (a weight: distinct on
    the TP ranks of depth 0), else one block per grid column (distinct on the first q)."""
    param = nn.Parameter(shard.to(device=device, dtype=dtype).contiguous())
    set_tp_attributes(param, partition_dim=0 if sharded else None)
    param.distinct_tp_ranks = range(grid.q * grid.q if sharded else grid.q)
    return param


class GridLinear(nn.Module):
    """``y = x W^T + b`` with x ``[s, b/(dq), in/q]`` -> ``(y, None)``, y ``[s, b/(dq), out/q]``
    (``grid.py``; a pair as the 1d layers return); the full W ``[out, in]`` and b ``[out]`` are
    those of ``nn.Linear(in, out)``."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        grid: Grid,
        bias: bool = True,
        init_method: InitMethod = default_init,
        stride: int = 1,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
    ):
        super().__init__()
        divide(input_size, grid.q, what="input_size")
        divide(output_size, grid.q * stride, what="output_size")
        self.grid = grid
        full = torch.empty(output_size, input_size, dtype=torch.float32)
        init_method(full)
        self.weight = grid_parameter(
            _block(full, grid, stride=stride), grid, dtype=params_dtype, device=device, sharded=True
        )
        self.bias = None
        if bias:
            zeros = torch.zeros(output_size // grid.q)
            self.bias = grid_parameter(
                zeros, grid, dtype=params_dtype, device=device, sharded=False
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = grid_linear(x, self.weight, self.grid)  # [s, b/(dq), out/q]
        if self.bias is not None:
            y = y + replicated_param(self.bias, self.grid.row_depth_group)
        return y, None


class _GridNorm(nn.Module):
    """The scale (and shift) of a norm over a hidden dim split over the grid row: ``[h/q]``,
    column block ``col``, replicated over the d x q ranks of ``row_depth_group``."""

    has_shift = False  # LayerNorm's bias

    def __init__(
        self,
        hidden_size: int,
        *,
        grid: Grid,
        eps: float = 1e-5,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
    ):
        super().__init__()
        self.grid, self.eps, self.hidden_size = grid, eps, hidden_size
        local = divide(hidden_size, grid.q, what="hidden_size")
        self.weight = grid_parameter(
            torch.ones(local), grid, dtype=params_dtype, device=device, sharded=False
        )
        self.bias = None
        if self.has_shift:
            self.bias = grid_parameter(
                torch.zeros(local), grid, dtype=params_dtype, device=device, sharded=False
            )

    def _mean(self, x: torch.Tensor) -> torch.Tensor:
        """The mean over the whole hidden dim of ``x`` ``[..., h/q]``: ``[..., 1]``."""
        return sum_over(x.sum(-1, keepdim=True), self.grid.col_group) / self.hidden_size

    def _params(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        group = self.grid.row_depth_group
        bias = None if self.bias is None else replicated_param(self.bias, group)
        return replicated_param(self.weight, group), bias


class GridLayerNorm(_GridNorm):
    """LayerNorm over the hidden dim of ``[s, b/(dq), h/q]``: mean and variance summed over the
    grid row (``col_group``). In fp32 whatever ``x``'s dtype, scale and shift included, the
    output cast back (``F.layer_norm``'s arithmetic: in fp16 the backward of statistics taken in
    fp16 overflows under loss scaling)."""

    has_shift = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        centred = x32 - self._mean(x32)
        var = self._mean(centred * centred)
        weight, bias = self._params()
        y = centred * torch.rsqrt(var + self.eps) * weight.float() + bias.float()
        return y.to(x.dtype)


class GridRMSNorm(_GridNorm):
    """RMSNorm over the hidden dim of ``[s, b/(dq), h/q]``: the mean square summed over the grid
    row (``col_group``); normalised in fp32, cast back, then scaled (``fusions.rms_norm``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(self._mean(x32 * x32) + self.eps)
        return self._params()[0] * y.to(x.dtype)


class GridEmbedding(nn.Module):
    """Embedding of ids ``[s, b/(dq)]`` -> ``[s, b/(dq), h/q]``. The padded table ``[V_pad, h]`` is
    split ``[V_pad/q, h/q]``: vocab block ``row``, hidden block ``col``, the same on every depth.

    The grid column's ids are gathered (``row_group``), each rank looks up those in its vocab
    block (zero elsewhere), and a reduce-scatter over ``row_group`` sums the q vocab blocks and
    hands each rank its own batch block; backward is the all-gather of the grads.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        grid: Grid,
        make_vocab_size_divisible_by: int = 128,
        init_method: InitMethod = default_init,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
    ):
        super().__init__()
        self.grid, self.num_embeddings = grid, num_embeddings
        self.padded_num_embeddings = padded_vocab_size(
            num_embeddings,
            make_vocab_size_divisible_by=make_vocab_size_divisible_by,
            tp_size=grid.q,
        )
        divide(embedding_dim, grid.q, what="embedding_dim")
        self.num_embeddings_per_partition = self.padded_num_embeddings // grid.q
        self.vocab_start = grid.row * self.num_embeddings_per_partition
        full = torch.zeros(self.padded_num_embeddings, embedding_dim)
        init_method(full[:num_embeddings])
        shard = full.chunk(grid.q, 0)[grid.row].chunk(grid.q, 1)[grid.col]
        self.weight = grid_parameter(shard, grid, dtype=params_dtype, device=device, sharded=True)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        ids = gather_first(ids.t().contiguous(), self.grid.row_group)  # [q b/(dq), s]
        outside = (ids < self.vocab_start) | (
            ids >= self.vocab_start + self.num_embeddings_per_partition
        )
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        weight = replicated_param(self.weight, self.grid.depth_group)
        out = F.embedding(local, weight).masked_fill(outside.unsqueeze(-1), 0.0)
        out = reduce_scatter_to_sp_region(out, self.grid.row_group)  # [b/(dq), s, h/q]
        return out.transpose(0, 1)


class GridVocabOutput(GridEmbedding):
    """The output layer over the padded vocabulary, in the embedding table's layout (so a tied
    model passes the word embedding's block as ``weight``): ``(logits, None)``, logits
    ``[s, b/(dq), V_pad/q]`` of x ``[s, b/(dq), h/q]``, vocab block ``col``."""

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None):
        return grid_vocab_linear(x, self.weight if weight is None else weight, self.grid), None


def grid_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    grid: Grid,
    vocab_size: int | None = None,
    label_smoothing: float = 0.0,
    loss_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token loss ``[s, b/(dq)]`` of logits ``[s, b/(dq), V_pad/q]`` (the vocab split over the
    grid row, as a ``GridLinear``'s output) against this batch block's target ids: the 1d
    vocab-parallel cross-entropy over ``col_group``."""
    return vocab_parallel_cross_entropy(
        logits,
        target,
        tp_group=grid.col_group,
        vocab_size=vocab_size,
        label_smoothing=label_smoothing,
        loss_mask=loss_mask,
    )

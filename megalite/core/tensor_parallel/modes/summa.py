"""The grid's autograd collectives and its linear product (SUMMA in its all-gather form).

    grid_linear(x, w, grid)   fwd: y = x W^T with x gathered over the grid row (col_group) and W
                                   gathered over the grid column (row_group)
                              bwd: x and W gathered again; dx reduce-scattered over the grid row;
                                   dW reduce-scattered over the grid column, then all-reduced
                                   over depth
    grid_vocab_linear(x, E)   the same product with the weight blocked the other way round (a
                              vocab-split embedding table E [V/q, h/q], vocab block row, hidden
                              block col, used as the output layer, tied or not):
                              fwd: E gathered over the grid column, partial logits
                                   reduce-scattered over the grid row (vocab block col)
                              bwd: E gathered again, dy over the grid row; dE reduce-scattered
                                   over the grid column, then all-reduced over depth
    sum_over(x, group)        fwd: all-reduce   bwd: all-reduce (every rank's output feeds a
                                   different part of the loss, so the grads are summed back)
    replicated_param(p, g)    fwd: identity     bwd: all-reduce of a replicated parameter's grad

Weight grads are summed over ranks in fp32 (and returned in their dtype), as the data-parallel
reduction sums them: in bf16 / fp16 each partial sum would round again.

Shapes on rank (depth, row, col) of a ``d x q x q`` grid (``grid.py``)::

    x  [s, b/(dq), in/q]  --all-gather last dim over col_group-->  [s, b/(dq), in]
    W  [out/q, in/q]      --all-gather dim 1 over row_group------>  [out/q, in]
    y = x_row @ W_col^T   [s, b/(dq), out/q]       (batch block depth*q + row, out block col)

Gathering the q blocks at once moves the same bytes as SUMMA's q broadcasts (each rank receives
the q - 1 blocks it lacks), at the price of holding them all while the product runs. Only the
blocks are saved for backward, which gathers them again (SUMMA broadcasts them again too), so the
saved activations shrink with the grid as the activations do. Backward, with ``dy`` the local
block: ``dy @ W_col`` is this rank's share of every in block of dx (a sum over the grid row's out
blocks): reduce-scatter over col_group. ``dy^T @ x_row`` is this batch block's share of every in
block of the weight's column: reduce-scatter over row_group sums the q batch blocks of the grid,
the all-reduce over depth the d grids.
"""

from __future__ import annotations

import torch

from megalite.core.groups import all_reduce_tensor, group_size
from megalite.core.tensor_parallel.mappings import gather_first, reduce_scatter_first


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """Sum ``x`` over ``group``, in place on a contiguous copy when needed."""
    if group_size(group) == 1:
        return x
    x = x.contiguous()
    all_reduce_tensor(x, group, what="grid")
    return x


def _gather_dim(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """All-gather ``x`` over ``group``, the blocks concatenated along ``dim`` in rank order."""
    if group_size(group) == 1:
        return x
    stacked = gather_first(x.unsqueeze(0), group)  # [n, *x.shape]
    return torch.cat(stacked.unbind(0), dim=dim)


def _reduce_scatter_dim(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Sum ``x`` over ``group`` and keep this rank's block of ``dim``."""
    n = group_size(group)
    if n == 1:
        return x
    blocks = torch.stack(x.chunk(n, dim=dim))  # [n, ...block]
    return reduce_scatter_first(blocks, group).squeeze(0)


def _sum_weight_grad(part: torch.Tensor, dim: int, row_group, depth_group) -> torch.Tensor:
    """This rank's block of a weight grad from every batch block's ``part``: reduce-scatter
    ``dim`` over the grid column, all-reduce over depth. The sums run in fp32 (the grad's dtype
    on return): they add the grads of different samples, as the data-parallel reduction does in
    fp32, and in bf16 / fp16 each partial sum would round again (2e-3 relative on the loss of an
    fp16 run after 3 steps, against 1e-5 for 1d tensor parallelism)."""
    summed = _reduce_scatter_dim(part.float(), row_group, dim)
    return _all_reduce(summed.contiguous(), depth_group).to(part.dtype)


class _GridLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, col_group, row_group, depth_group):
        x_row = _gather_dim(x, col_group, -1)  # [s, b/(dq), in]
        w_col = _gather_dim(weight, row_group, 1)  # [out/q, in]
        ctx.save_for_backward(x, weight)  # the blocks: gathered again in backward
        ctx.groups = (col_group, row_group, depth_group)
        return x_row @ w_col.t()  # [s, b/(dq), out/q]

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        col_group, row_group, depth_group = ctx.groups
        x_row = _gather_dim(x, col_group, -1)  # [s, b/(dq), in]
        w_col = _gather_dim(weight, row_group, 1)  # [out/q, in]
        dx = _reduce_scatter_dim(dy @ w_col, col_group, -1)  # [s, b/(dq), in/q]
        dw_col = dy.reshape(-1, dy.shape[-1]).t() @ x_row.reshape(-1, x_row.shape[-1])
        return dx, _sum_weight_grad(dw_col, 1, row_group, depth_group), None, None, None


def grid_linear(x: torch.Tensor, weight: torch.Tensor, grid) -> torch.Tensor:
    """``x @ W^T`` on the grid's blocks (module docstring); ``grid``: a ``Grid``."""
    return _GridLinear.apply(x, weight, grid.col_group, grid.row_group, grid.depth_group)


class _GridVocabLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, col_group, row_group, depth_group):
        w_all = _gather_dim(weight, row_group, 0)  # [V, h/q]: every vocab block, hidden col
        ctx.save_for_backward(x, weight)  # the block: gathered again in backward
        ctx.groups = (col_group, row_group, depth_group)
        partial = x @ w_all.t()  # [s, b/(dq), V]: this hidden block's share
        return _reduce_scatter_dim(partial, col_group, -1)  # [s, b/(dq), V/q], vocab block col

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        col_group, row_group, depth_group = ctx.groups
        w_all = _gather_dim(weight, row_group, 0)  # [V, h/q]
        dy_all = _gather_dim(dy.contiguous(), col_group, -1)  # [s, b/(dq), V]
        dx = dy_all @ w_all  # [s, b/(dq), h/q]: whole, no sum needed
        dw_all = dy_all.reshape(-1, dy_all.shape[-1]).t() @ x.reshape(-1, x.shape[-1])  # [V, h/q]
        return dx, _sum_weight_grad(dw_all, 0, row_group, depth_group), None, None, None


def grid_vocab_linear(x: torch.Tensor, weight: torch.Tensor, grid) -> torch.Tensor:
    """Logits ``x @ E^T`` of x ``[s, b/(dq), h/q]`` against a ``GridEmbedding``'s table block
    ``[V/q, h/q]`` (module docstring): ``[s, b/(dq), V/q]``, vocab block ``col``."""
    return _GridVocabLinear.apply(x, weight, grid.col_group, grid.row_group, grid.depth_group)


class _SumOver(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, dy):
        return _all_reduce(dy.clone(), ctx.group), None


class _Replicated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, param, group):
        ctx.group = group
        return param.view_as(param)

    @staticmethod
    def backward(ctx, dy):
        return _all_reduce(dy.float(), ctx.group).to(dy.dtype), None


def replicated_param(param: torch.Tensor, group) -> torch.Tensor:
    """fwd: ``param`` as is; bwd: its grad summed over ``group`` (a parameter replicated there,
    each copy seeing other samples or other columns), in fp32 as ``_sum_weight_grad``."""
    if group_size(group) == 1:
        return param
    return _Replicated.apply(param, group)


def sum_over(x: torch.Tensor, group) -> torch.Tensor:
    """fwd: all-reduce (sum) over ``group``; bwd: all-reduce of the grads (module docstring)."""
    if group_size(group) == 1:
        return x
    return _SumOver.apply(x, group)

"""The collectives of the 3D layers: gather and reduce-scatter along any dim of a tensor, and an
all-reduce whose adjoint is an all-reduce.

    gather_dim(x, dim, group, stride=1)          concatenate every rank's x along dim
    reduce_scatter_dim(x, dim, group, stride=1)  sum over the group, keep this rank's part of dim
    all_reduce_sum(x, group)                     fwd: all-reduce   bwd: all-reduce (autograd)
    copy_to_group(x, group)                      fwd: identity     bwd: all-reduce (autograd)

``stride`` > 1: ``dim`` holds ``stride`` stacked blocks (SwiGLU's ``[gate; up]``), each rank holds
its part of every block, and the gather concatenates block by block (the reduce-scatter is its
adjoint), so the result is ``stride`` whole-group blocks in order. The first two have no autograd:
the 3D layers call them inside their own backward. Every collective goes through
``megalite.core.groups`` (so the op recorder counts it); on a group of one each returns its input.
"""

from __future__ import annotations

import torch

from megalite.core.groups import (
    all_gather_tensor,
    all_reduce_tensor,
    group_size,
    reduce_scatter_tensor,
)


def gather_dim(
    x: torch.Tensor, dim: int, group, *, stride: int = 1, what: str = ""
) -> torch.Tensor:
    """``x`` # [..., d, ...] -> [..., n * d, ...] along ``dim`` (n = the group's size)."""
    n = group_size(group)
    if n == 1:
        return x
    dim = dim % x.dim()
    x = x.contiguous()
    stacked = torch.empty((n, *x.shape), dtype=x.dtype, device=x.device)
    all_gather_tensor(stacked.view(n * x.shape[0], *x.shape[1:]), x, group, what=what)
    # [n, ..., stride, d/stride, ...] -> [..., stride, n, d/stride, ...]
    d = x.shape[dim]
    split = stacked.view(n, *x.shape[:dim], stride, d // stride, *x.shape[dim + 1 :])
    moved = split.movedim(0, dim + 1)
    return moved.reshape(*x.shape[:dim], n * d, *x.shape[dim + 1 :])


def reduce_scatter_dim(
    x: torch.Tensor, dim: int, group, *, stride: int = 1, what: str = ""
) -> torch.Tensor:
    """``x`` # [..., n * d, ...] -> [..., d, ...]: the sum over the group, this rank's part."""
    n = group_size(group)
    if n == 1:
        return x
    dim = dim % x.dim()
    total = x.shape[dim]
    if total % (n * stride):
        raise ValueError(f"dim {dim} of size {total} does not split into {n} x stride {stride}")
    d = total // n
    split = x.reshape(*x.shape[:dim], stride, n, d // stride, *x.shape[dim + 1 :])
    front = split.movedim(dim + 1, 0).contiguous()  # [n, ..., stride, d/stride, ...]
    out = torch.empty(front.shape[1:], dtype=x.dtype, device=x.device)
    reduce_scatter_tensor(out, front.flatten(0, 1), group, what=what)
    return out.reshape(*x.shape[:dim], d, *x.shape[dim + 1 :])


def _all_reduce(x: torch.Tensor, group, what: str) -> torch.Tensor:
    x = x.clone()  # never reduce a tensor autograd or the caller still holds
    all_reduce_tensor(x, group, what=what)
    return x


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, what):
        ctx.group, ctx.what = group, what
        return _all_reduce(x, group, what)

    @staticmethod
    def backward(ctx, dy):
        return _all_reduce(dy, ctx.group, f"{ctx.what} grad"), None, None


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, what):
        ctx.group, ctx.what = group, what
        return x

    @staticmethod
    def backward(ctx, dy):
        return _all_reduce(dy.float(), ctx.group, ctx.what).to(dy.dtype), None, None


def all_reduce_sum(x: torch.Tensor, group, *, what: str = "") -> torch.Tensor:
    """Forward: the sum of ``x`` over ``group``. Backward: the sum of the grads over ``group``
    (every rank uses the sum, so each part's grad is every rank's grad of it)."""
    return _AllReduceSum.apply(x, group, what) if group_size(group) > 1 else x


def copy_to_group(x: torch.Tensor, group, *, what: str = "") -> torch.Tensor:
    """Forward: identity. Backward: the sum of the grads over ``group`` (a parameter replicated
    over ``group``, each copy seeing different rows: every copy gets the whole grad), in fp32
    as every sum of a weight grad over samples (``reduce_scatter_grad``)."""
    return _CopyToGroup.apply(x, group, what) if group_size(group) > 1 else x


def reduce_scatter_grad(
    x: torch.Tensor, dim: int, group, *, stride: int = 1, what: str = ""
) -> torch.Tensor:
    """``reduce_scatter_dim`` of a weight grad, summed in fp32 and returned in ``x``'s dtype: the
    ranks hold the grads of different samples, which the data-parallel reduction too adds in
    fp32; in bf16 / fp16 each partial sum would round again."""
    if group_size(group) == 1:
        return x
    return reduce_scatter_dim(x.float(), dim, group, stride=stride, what=what).to(x.dtype)

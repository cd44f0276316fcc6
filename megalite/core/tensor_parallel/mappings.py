"""Autograd collectives that move activations into and out of tensor- and sequence-parallel regions.

Each function is named by what it does forward; its backward is the adjoint:

    copy_to_tp_region            fwd: identity              bwd: all-reduce
    reduce_from_tp_region        fwd: all-reduce            bwd: identity
    scatter_to_tp_region         fwd: split last dim        bwd: all-gather last dim
    gather_from_tp_region        fwd: all-gather last dim   bwd: split last dim
    scatter_to_sp_region         fwd: split first dim       bwd: all-gather first dim
    gather_from_sp_region        fwd: all-gather first dim  bwd: reduce-scatter first dim
                                                                 (split if the grad is whole)
    reduce_scatter_to_sp_region  fwd: reduce-scatter first  bwd: all-gather first dim

``gather_first`` and ``reduce_scatter_first`` are the same collectives without autograd (the
sequence-parallel linear calls them in its own backward). "first dim" is the sequence dim of
``[s, b, h]`` activations. Every function takes the group it communicates over (the TP group; the
allgather token dispatcher of MoE also uses the etp x ep group); on a group of one it returns its
input unchanged. ``None`` means a group of one (no communication): an oracle model built with
``ParallelState.single()`` inside a multi-rank test. The generic group helpers (size, rank, the
raw tensor collectives) live in ``megalite.core.groups``.
"""

from __future__ import annotations

import torch

from megalite.core.groups import (
    all_gather_tensor,
    all_reduce_tensor,
    group_rank,
    group_size,
    reduce_scatter_tensor,
)


# --- the raw operations (no autograd) ---
def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    x = x.contiguous()
    all_reduce_tensor(x, group)
    return x


def _split_last(x: torch.Tensor, group) -> torch.Tensor:
    n = group_size(group)
    if n == 1:
        return x
    if x.shape[-1] % n:
        raise ValueError(f"last dim {x.shape[-1]} is not divisible by the TP size {n}")
    return x.chunk(n, dim=-1)[group_rank(group)].contiguous()


def _split_first(x: torch.Tensor, group) -> torch.Tensor:
    n = group_size(group)
    if n == 1:
        return x
    if x.shape[0] % n:
        raise ValueError(
            f"sequence dim {x.shape[0]} is not divisible by the TP size {n} (sequence parallel)"
        )
    return x.chunk(n, dim=0)[group_rank(group)].contiguous()


def gather_first(x: torch.Tensor, group) -> torch.Tensor:
    n = group_size(group)
    if n == 1:
        return x
    x = x.contiguous()
    out = torch.empty((n * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_tensor(out, x, group)
    return out


def _gather_last(x: torch.Tensor, group) -> torch.Tensor:
    n = group_size(group)
    if n == 1:
        return x
    # gather along a new leading dim (contiguous collective), then move it next to the last dim
    stacked = gather_first(x.unsqueeze(0), group)  # [n, ..., h/n]
    return torch.cat(stacked.unbind(0), dim=-1)


def reduce_scatter_first(x: torch.Tensor, group) -> torch.Tensor:
    n = group_size(group)
    if n == 1:
        return x
    if x.shape[0] % n:
        raise ValueError(
            f"sequence dim {x.shape[0]} is not divisible by the TP size {n} (sequence parallel)"
        )
    x = x.contiguous()
    out = torch.empty((x.shape[0] // n, *x.shape[1:]), dtype=x.dtype, device=x.device)
    reduce_scatter_tensor(out, x, group)
    return out


# --- autograd functions ---
class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, dy):
        # reduce a copy: the incoming grad may be a tensor its owner still uses
        return _all_reduce(dy.clone(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, dy):
        return dy, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, dy):
        return _gather_last(dy, ctx.group), None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx, dy):
        return _split_last(dy, ctx.group), None


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_first(x, group)

    @staticmethod
    def backward(ctx, dy):
        return gather_first(dy, ctx.group), None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, grad_is_partial):
        ctx.group, ctx.grad_is_partial = group, grad_is_partial
        return gather_first(x, group)

    @staticmethod
    def backward(ctx, dy):
        if ctx.grad_is_partial:
            return reduce_scatter_first(dy, ctx.group), None, None
        return _split_first(dy, ctx.group), None, None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_first(x, group)

    @staticmethod
    def backward(ctx, dy):
        return gather_first(dy, ctx.group), None


def copy_to_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    """Forward: identity. Backward: all-reduce over ``group`` (entering a column-parallel layer)."""
    return _CopyToTP.apply(x, group) if group_size(group) > 1 else x


def reduce_from_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    """Forward: all-reduce over ``group`` (leaving a row-parallel layer). Backward: identity."""
    return _ReduceFromTP.apply(x, group) if group_size(group) > 1 else x


def scatter_to_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    """Forward: keep this rank's chunk of the last dim. Backward: all-gather the last dim."""
    return _ScatterToTP.apply(x, group) if group_size(group) > 1 else x


def gather_from_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    """Forward: all-gather the last dim. Backward: keep this rank's chunk of the last dim."""
    return _GatherFromTP.apply(x, group) if group_size(group) > 1 else x


def scatter_to_sp_region(x: torch.Tensor, group) -> torch.Tensor:
    """Forward: keep this rank's chunk of the sequence dim. Backward: all-gather it."""
    return _ScatterToSP.apply(x, group) if group_size(group) > 1 else x


def gather_from_sp_region(x: torch.Tensor, group, *, grad_is_partial: bool = True) -> torch.Tensor:
    """Forward: all-gather the sequence dim ``[s/tp, b, h] -> [s, b, h]``.

    Backward: reduce-scatter when the consumer is a TP region whose ranks each hold a partial
    gradient (the input of a column-parallel layer); plain split when the gradient is already whole.
    """
    if group_size(group) == 1:
        return x
    return _GatherFromSP.apply(x, group, grad_is_partial)


def reduce_scatter_to_sp_region(x: torch.Tensor, group) -> torch.Tensor:
    """Forward: reduce-scatter the sequence dim ``[s, b, h] -> [s/tp, b, h]``.
    Backward: all-gather."""
    return _ReduceScatterToSP.apply(x, group) if group_size(group) > 1 else x

"""Autograd collectives of the token dispatchers, with variable sizes per rank.

    all_to_all(x, group, out_splits, in_splits)   fwd: all-to-all (rows)      bwd: the reverse one
    gather_v(x, group, counts)                    fwd: all-gather, uneven     bwd: reduce-scatter
    reduce_scatter_v(x, group, counts)            fwd: reduce-scatter, uneven bwd: all-gather

Rows are dim 0 of ``[n, h]``. ``in_splits[j]`` rows go to rank j of ``group``; ``out_splits[j]``
rows come from it. ``counts[j]`` is rank j's row count (in group order). On a group of one (or
``None``) every function returns its input. The uneven gather / reduce-scatter pad every rank's
rows to ``max(counts)`` (the counts are known to every rank: the dispatcher exchanges them once per
layer) and run one ``all_gather_into_tensor`` / ``reduce_scatter_tensor``: a rank hands the
collective ``max(counts)`` rows and gets ``n max(counts)`` back (an all-to-all of ``n`` copies of
its rows took ``n`` times its rows in and ``sum(counts)`` out).
"""

from __future__ import annotations

import torch

from megalite.core.groups import (
    all_gather_tensor,
    all_to_all_tensor,
    group_rank,
    group_size,
    reduce_scatter_tensor,
)


def _all_to_all_raw(x: torch.Tensor, group, out_splits: list[int], in_splits: list[int]):
    x = x.contiguous()
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    all_to_all_tensor(out, x, out_splits, in_splits, group, what="tokens")
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, out_splits, in_splits):
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        return _all_to_all_raw(x, group, out_splits, in_splits)

    @staticmethod
    def backward(ctx, dy):
        return _all_to_all_raw(dy, ctx.group, ctx.in_splits, ctx.out_splits), None, None, None


def all_to_all(x: torch.Tensor, group, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
    """Forward: send ``in_splits[j]`` rows to rank j, receive ``out_splits[j]`` from it (in rank
    order). Backward: the same exchange reversed."""
    if group_size(group) == 1:
        return x
    return _AllToAll.apply(x, group, list(out_splits), list(in_splits))


def _gather_v_raw(x: torch.Tensor, group, counts: list[int]) -> torch.Tensor:
    """Every rank's rows padded to the largest count, one all-gather, the padding dropped."""
    n, m = group_size(group), max(counts)
    rest = x.shape[1:]
    if m == 0:
        return x.new_empty((0, *rest))
    x = x.contiguous()
    if x.shape[0] < m:
        x = torch.cat([x, x.new_zeros((m - x.shape[0], *rest))])
    out = x.new_empty((n * m, *rest))
    all_gather_tensor(out, x, group)
    if all(c == m for c in counts):
        return out
    return torch.cat([out[j * m : j * m + c] for j, c in enumerate(counts)])


def _reduce_scatter_v_raw(x: torch.Tensor, group, counts: list[int]) -> torch.Tensor:
    """Rank j's block (``counts[j]`` rows, in order) placed at ``j * max(counts)`` of a padded
    buffer, one reduce-scatter, this rank's rows kept."""
    n, m, mine = group_size(group), max(counts), counts[group_rank(group)]
    rest = x.shape[1:]
    if m == 0:
        return x.new_empty((0, *rest))
    x = x.contiguous()
    if not all(c == m for c in counts):
        padded, start = x.new_zeros((n * m, *rest)), 0
        for j, c in enumerate(counts):
            padded[j * m : j * m + c] = x[start : start + c]
            start += c
        x = padded
    out = x.new_empty((m, *rest))
    reduce_scatter_tensor(out, x, group)
    return out if mine == m else out[:mine]


class _GatherV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, counts):
        ctx.group, ctx.counts = group, counts
        return _gather_v_raw(x, group, counts)

    @staticmethod
    def backward(ctx, dy):
        return _reduce_scatter_v_raw(dy, ctx.group, ctx.counts), None, None


class _ReduceScatterV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, counts):
        ctx.group, ctx.counts = group, counts
        return _reduce_scatter_v_raw(x, group, counts)

    @staticmethod
    def backward(ctx, dy):
        return _gather_v_raw(dy, ctx.group, ctx.counts), None, None


def gather_v(x: torch.Tensor, group, counts: list[int]) -> torch.Tensor:
    """Forward: concatenate every rank's rows in group order (rank j holds ``counts[j]``).
    Backward: sum the grads over the group and keep this rank's rows (reduce-scatter)."""
    if group_size(group) == 1:
        return x
    return _GatherV.apply(x, group, list(counts))


def reduce_scatter_v(x: torch.Tensor, group, counts: list[int]) -> torch.Tensor:
    """Forward: ``x`` holds rank j's ``counts[j]`` rows in group order; sum them over the group and
    keep this rank's rows. Backward: all-gather (``gather_v``)."""
    if group_size(group) == 1:
        return x
    return _ReduceScatterV.apply(x, group, list(counts))


def all_to_all_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """``counts`` # [n, k] int64: row j for rank j; returns # [n, k]: row j is what rank j sent
    to this rank (no autograd)."""
    n = group_size(group)
    if n == 1:
        return counts
    return _all_to_all_raw(counts, group, [1] * n, [1] * n)


def all_gather_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """``counts`` # [k] -> # [n, k]: every rank's row, in group order (no autograd)."""
    n = group_size(group)
    if n == 1:
        return counts.unsqueeze(0)
    out = counts.new_empty((n * counts.shape[0], *counts.shape[1:]))
    all_gather_tensor(out, counts.contiguous(), group)
    return out.view(n, *counts.shape)

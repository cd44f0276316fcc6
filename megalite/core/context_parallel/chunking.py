"""The load-balanced split of a sequence over the context-parallel (cp) axis.

The sequence of ``s`` tokens is cut into ``2 x CP`` chunks of ``c = s / (2 CP)`` tokens; cp rank r
keeps chunks ``r`` and ``2CP-1-r``, concatenated in that order::

    CP = 2, s = 8:  chunks [0 1 | 2 3 | 4 5 | 6 7]  ->  rank 0: tokens 0 1 6 7, rank 1: 2 3 4 5

Under causal attention the early chunk of a rank sees few keys and its late chunk many, so every
rank does the same work. Tokens, labels, the loss mask and the positions (RoPE, learned) are all
sliced with this one rule; ``rank_major_to_natural`` undoes it for a gathered sequence.
"""

from __future__ import annotations

import torch


def check_cp_seq_length(seq_length: int, cp_size: int) -> None:
    """ValueError (one line) unless ``seq_length`` divides by ``2 x cp_size``."""
    if seq_length % (2 * cp_size):
        raise ValueError(
            f"seq_length {seq_length} is not divisible by 2 x context_parallel_size "
            f"{cp_size} = {2 * cp_size}; use a multiple of {2 * cp_size}"
        )


def cp_chunk_ids(cp_size: int, cp_rank: int) -> tuple[int, int]:
    """The two chunk indices (of ``2 x cp_size``) that cp rank ``cp_rank`` holds, in order."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def cp_token_indices(
    seq_length: int, cp_size: int, cp_rank: int, device: torch.device | None = None
) -> torch.Tensor:
    """Positions (0-based, into the full sequence) of the ``seq_length / cp_size`` tokens this rank
    keeps, in its local order # [s/cp] int64 (``0..s-1`` on one rank, any ``s``)."""
    if cp_size == 1:
        return torch.arange(seq_length, device=device)
    check_cp_seq_length(seq_length, cp_size)
    c = seq_length // (2 * cp_size)
    first, second = cp_chunk_ids(cp_size, cp_rank)
    return torch.cat(
        (
            torch.arange(first * c, (first + 1) * c, device=device),
            torch.arange(second * c, (second + 1) * c, device=device),
        )
    )


def split_for_cp(x: torch.Tensor, dim: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """This rank's two chunks of ``x`` along ``dim`` (the full sequence), concatenated; a view-free
    copy of ``s / cp_size`` entries. ``cp_size`` 1 returns ``x``."""
    if cp_size == 1:
        return x
    check_cp_seq_length(x.shape[dim], cp_size)
    chunks = x.chunk(2 * cp_size, dim=dim)
    first, second = cp_chunk_ids(cp_size, cp_rank)
    return torch.cat((chunks[first], chunks[second]), dim=dim)


def rank_major_to_natural(seq_length: int, cp_size: int) -> torch.Tensor:
    """Index ``perm`` with ``natural = rank_major.index_select(dim, perm)``, where ``rank_major``
    is the ranks' local sequences concatenated in rank order (what a gather over cp returns)
    # [s] int64; ``perm.argsort()`` goes back."""
    order = torch.cat([cp_token_indices(seq_length, cp_size, r) for r in range(cp_size)])
    return order.argsort()

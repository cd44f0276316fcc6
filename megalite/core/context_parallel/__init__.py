"""Context parallelism: attention over a sequence split across the cp axis (``chunking``).

Three designs, the values of ``cp_comm_type`` (``CP_COMM_TYPES``, Megatron's): ``p2p``
(``ring``), ``a2a`` (``all_to_all``, Ulysses) and ``all_gather``. ``context_parallel_attention``
picks one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megalite.core.context_parallel.all_gather import all_gather_attention
from megalite.core.context_parallel.all_to_all import all_to_all, all_to_all_attention
from megalite.core.context_parallel.chunking import (
    check_cp_seq_length,
    cp_chunk_ids,
    cp_token_indices,
    rank_major_to_natural,
    split_for_cp,
)
from megalite.core.context_parallel.comm import CommStats
from megalite.core.context_parallel.ring import ring_attention

CP_COMM_TYPES = ("p2p", "a2a", "all_gather")

__all__ = [
    "CP_COMM_TYPES",
    "CommStats",
    "all_gather_attention",
    "all_to_all",
    "all_to_all_attention",
    "check_cp_seq_length",
    "context_parallel_attention",
    "cp_chunk_ids",
    "cp_token_indices",
    "rank_major_to_natural",
    "ring_attention",
    "split_for_cp",
]


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    cp_group,
    comm_type: str,
    scale: float,
    dropout_p: float = 0.0,
    core_attention: Callable | None = None,
    stats: CommStats | None = None,
) -> torch.Tensor:
    """Causal attention of this cp rank's two chunks over the whole sequence.

    q # [b, n, s/cp, d]; k, v # [b, g, s/cp, d] (query groups, not expanded), local chunk order.
    ``core_attention(q, k, v)`` (a2a only): causal attention on # [b, n/cp, s, d] with k/v expanded;
    it applies its own dropout. Returns # [b, n, s/cp, d]."""
    if comm_type == "p2p":
        return ring_attention(
            q, k, v, cp_group=cp_group, scale=scale, dropout_p=dropout_p, stats=stats
        )
    if comm_type == "all_gather":
        return all_gather_attention(
            q, k, v, cp_group=cp_group, scale=scale, dropout_p=dropout_p, stats=stats
        )
    if comm_type == "a2a":
        if core_attention is None:

            def core_attention(q, k, v):
                return torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale
                )

        return all_to_all_attention(
            q, k, v, cp_group=cp_group, core_attention=core_attention, stats=stats
        )
    raise ValueError(f"cp_comm_type must be one of {', '.join(CP_COMM_TYPES)}, got {comm_type!r}")

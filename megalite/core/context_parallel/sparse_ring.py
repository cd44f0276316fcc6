"""Ring attention (``cp_comm_type="p2p"``) under any block mask: windows, sparse layouts, documents.

The ring loop is ``ring``'s; this module gives it a block-sparse ``RingPlan``. At step i this rank
holds the K/V of rank ``src = (r - i) mod CP`` and computes the blocks of ``plans[src]``: the block
plan (``core.attention.masks``) of this rank's query positions (and documents) against ``src``'s
key positions. A step is needed when some rank's queries may read the keys it holds then under
the mask's band (causality and window) and the chunk rule (``chunking``); documents and layouts
only hide more, so the band decides for every rank alike, without looking at the data. K/V skip
the steps no rank needs (``ring``: they jump to the next needed one).
"""

from __future__ import annotations

import torch

from megalite.core.attention.masks import BlockPlan, MaskSpec
from megalite.core.context_parallel.chunking import cp_chunk_ids
from megalite.core.context_parallel.comm import CommStats
from megalite.core.context_parallel.ring import RingBlock, RingPlan, run_ring
from megalite.core.groups import group_rank, group_size

_ALL = slice(None)


def _chunks_meet(q_chunk: int, k_chunk: int, c: int, band: tuple[float, float]) -> bool:
    """Some key of chunk ``k_chunk`` lies in the band of some query of chunk ``q_chunk`` (chunks
    of ``c`` tokens): the range of ``k - q`` over the pair meets ``[lo, hi]``."""
    lo, hi = band
    base = (k_chunk - q_chunk) * c
    return max(base - (c - 1), lo) <= min(base + (c - 1), hi)


def needed_steps(spec: MaskSpec, seq_length: int, cp_size: int) -> tuple[bool, ...]:
    """Per ring step: whether any cp rank's queries may read the K/V it holds at that step under
    ``spec``'s band, the sequence of ``seq_length`` tokens split by the chunk rule."""
    c = seq_length // (2 * cp_size)
    needed = [True]  # step 0: the own K/V, nothing travels
    for step in range(1, cp_size):
        needed.append(
            any(
                _chunks_meet(a, b, c, spec.band)
                for r in range(cp_size)
                for a in cp_chunk_ids(cp_size, r)
                for b in cp_chunk_ids(cp_size, (r - step) % cp_size)
            )
        )
    return tuple(needed)


def sparse_ring_plan(plans: list[list[BlockPlan]], rank: int, seq_length: int) -> RingPlan:
    """This rank's ring plan from ``plans[src]`` (one ``BlockPlan`` per sample, or one for every
    sample) against each cp rank ``src``'s keys; a sample whose plan keeps no block is left out."""
    size = len(plans)
    needed = needed_steps(plans[0][0].spec, seq_length, size)
    blocks = []
    for step in range(size):
        per_sample = plans[(rank - step) % size]
        step_blocks = tuple(
            RingBlock(samples=_ALL if len(per_sample) == 1 else slice(i, i + 1), sparse=plan)
            for i, plan in enumerate(per_sample)
            if plan.num_computed
        )
        if step_blocks and not needed[step]:
            raise ValueError(
                f"cp rank {rank}'s block plan against rank {(rank - step) % size} keeps blocks "
                "outside the mask's band: plans must follow the chunk rule (cp_token_indices)"
            )
        blocks.append(step_blocks)
    return RingPlan(tuple(blocks), needed)


def sparse_ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plans: list[list[BlockPlan]],
    *,
    cp_group,
    scale: float,
    stats: CommStats | None = None,
) -> torch.Tensor:
    """Attention of this rank's tokens (its two chunks) over the whole sequence held by
    ``cp_group``, computing only the blocks of ``plans[src]`` (per sample, or one for every
    sample) against cp rank ``src``'s keys. q # [b, n, s/cp, d]; k, v # [b, g, s/cp, d]. Returns
    # [b, n, s/cp, d]."""
    seq_length = q.shape[2] * group_size(cp_group)
    plan = sparse_ring_plan(plans, group_rank(cp_group), seq_length)
    return run_ring(q, k, v, plan, cp_group=cp_group, scale=scale, stats=stats)

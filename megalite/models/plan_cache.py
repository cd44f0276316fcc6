"""The block plans of one model chunk's sparse or windowed layers, shared by those layers.

    cache = PlanCache()                  # one per TransformerBlock, handed to its layers
    plans = cache.plans(spec, attention_mask, block_size=64, seq_length=s, device=d)
    plans = cache.plans(spec, mask, block_size=64, seq_length=s, device=d, cp=(cp, q_rank, k_rank))

Layers with the same mask (``MaskSpec``) over the same positions get the same plans, so a plan's
kernel calls (``BlockPlan.calls``) and its flex ``BlockMask`` are built once, not once per layer.
Without documents a plan depends only on the shapes and is kept for every later step. With
documents (an ``attention_mask``) the plans hold for that mask tensor only: they are kept while
the same tensor, unmodified, comes back (every layer of one micro-batch's forward) and dropped
when another comes. The key is made of Python ints: no read of a device tensor, so no host sync
per layer on CUDA.
"""

from __future__ import annotations

import weakref

import torch

from megalite.core.attention.masks import BlockPlan, MaskSpec
from megalite.core.context_parallel import cp_token_indices
from megalite.models.attention_mask import block_plans, document_ids_of


class PlanCache:
    def __init__(self):
        self._fixed: dict[tuple, list[BlockPlan]] = {}  # no documents: every step
        self._mask: weakref.ref | None = None  # the attention mask the entries below are of
        self._mask_version = -1
        self._docs: torch.Tensor | None = None
        self._documents: dict[tuple, list[BlockPlan]] = {}
        self.built = 0  # plan lists built so far (what sharing saves is counted by tests)

    def plans(
        self,
        spec: MaskSpec,
        attention_mask: torch.Tensor | None,
        *,
        block_size: int,
        seq_length: int,
        device: torch.device,
        cp: tuple[int, int, int] | None = None,
    ) -> list[BlockPlan]:
        """The plans of ``spec`` over a sequence of ``seq_length`` tokens: every query against
        every key, or with ``cp = (cp_size, q_rank, k_rank)`` the queries of context-parallel
        rank ``q_rank`` against the keys of ``k_rank`` (``cp_token_indices``); documents from
        ``attention_mask`` (None: none)."""
        key = (spec, block_size, seq_length, cp, device)
        if attention_mask is None:
            entries, docs = self._fixed, None
        else:
            entries, docs = self._entries_of(attention_mask), self._docs
        plans = entries.get(key)
        if plans is None:
            if cp is None:
                q_pos = k_pos = torch.arange(seq_length, device=device)
            else:
                cp_size, q_rank, k_rank = cp
                q_pos = cp_token_indices(seq_length, cp_size, q_rank, device)
                k_pos = cp_token_indices(seq_length, cp_size, k_rank, device)
            plans = block_plans(spec, q_pos, k_pos, block_size=block_size, docs=docs)
            entries[key] = plans
            self.built += 1
        return plans

    def _entries_of(self, attention_mask: torch.Tensor) -> dict[tuple, list[BlockPlan]]:
        """The document plans of ``attention_mask``, emptied when it is not the mask they were
        built for (another tensor, or the same one modified in place)."""
        held = self._mask() if self._mask is not None else None
        if held is not attention_mask or self._mask_version != attention_mask._version:
            self._mask = weakref.ref(attention_mask)
            self._mask_version = attention_mask._version
            self._docs = document_ids_of(attention_mask)
            self._documents = {}
        return self._documents

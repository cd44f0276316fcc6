"""A ``BlockPlan`` run by PyTorch's ``flex_attention``: the fused kernel on CUDA.

    out = flex_plan_attention(q, k, v, plans, scale=scale)     # as block_sparse_attention

The plan already says which key blocks each query block needs (``blocks``) and which of them need
no entry mask (``full``); ``plan_block_mask`` hands exactly those to flex as a ``BlockMask``
(partial blocks with the plan's own entry predicate as ``mask_mod``, full blocks without), so the
kernel visits the blocks the block path computes and no others. On CUDA the kernel is
``torch.compile``'d flex attention (Triton, forward and backward fused, no gathered K/V); on CPU
flex runs eagerly (a dense reference: correct, not fast), which is how CI checks it. The block
path (``block_sparse``) stays the reference and the context-parallel ring's kernel: this path
returns no log-sum-exp to merge. flex's sparse block must be a multiple of its kernel's tiles
(128): a plan of such blocks is handed over as it is, a plan of smaller blocks that divide 128
(the default 64) with its blocks grouped by 128 (``coarsen``: a group is visited when any of its
blocks is, and masked entry by entry unless all of them are full).
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import replace

import torch

from megalite.core.attention.masks import BlockPlan, pad_end


@functools.cache
def flex_available() -> bool:
    """Whether this torch has flex attention (2.5 and later)."""
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


# flex's kernels tile a sparse block by 128 (forward) and by 64 or 128 (backward) on CUDA
FLEX_BLOCK_MULTIPLE = 128


def flex_block(block_size: int) -> int | None:
    """flex's sparse block for a plan of ``block_size`` tokens: the block itself when it is a
    multiple of ``FLEX_BLOCK_MULTIPLE``, that multiple when the block divides it (the plan's
    blocks grouped, ``coarsen``), else None (flex cannot run the plan)."""
    if block_size % FLEX_BLOCK_MULTIPLE == 0:
        return block_size
    return FLEX_BLOCK_MULTIPLE if FLEX_BLOCK_MULTIPLE % block_size == 0 else None


def flex_serves(q: torch.Tensor, plans: list[BlockPlan]) -> bool:
    """Whether ``flex_plan_attention`` runs ``plans`` here: CUDA, flex present, and every plan's
    block a multiple or a divisor of ``FLEX_BLOCK_MULTIPLE`` (``--attention-block-size``); else
    the block path does (CPU, where flex has no fused kernel and no backward)."""
    return (
        q.is_cuda and flex_available() and all(flex_block(p.block_size) is not None for p in plans)
    )


def _group(x: torch.Tensor, f: int, rows: int, cols: int) -> torch.Tensor:
    """bool # [nq, nk] padded with False to [rows * f, cols * f] -> # [rows, f, cols, f]."""
    out = x.new_zeros(rows * f, cols * f)
    out[: x.shape[0], : x.shape[1]] = x
    return out.view(rows, f, cols, f)


def coarsen(plan: BlockPlan, block: int) -> BlockPlan:
    """``plan`` at blocks of ``block`` tokens (a multiple of its own): a block is computed when
    any of its sub-blocks is and needs no mask when all of them need none; positions and
    documents padded to whole blocks (flex evaluates the entry predicate up to a block's end).
    The same mask: only whole blocks more are visited, each masked entry by entry."""
    f = block // plan.block_size
    if f == 1:
        return plan
    nq, nk = -(-plan.sq // block), -(-plan.sk // block)
    blocks = _group(plan.blocks, f, nq, nk).any(3).any(1)
    full = None
    if plan.full is not None:
        full = _group(plan.full, f, nq, nk).all(3).all(1)

    docs = {}
    if plan.q_doc is not None:
        docs = dict(
            q_doc=pad_end(plan.q_doc, nq * block, -1), k_doc=pad_end(plan.k_doc, nk * block, -2)
        )
    return replace(
        plan,
        block_size=block,
        q_pos=pad_end(plan.q_pos, nq * block, -1),
        k_pos=pad_end(plan.k_pos, nk * block, -1),
        **docs,
        blocks=blocks,
        groups=[],
        full=full,
        band=None,
        _calls={},
        flex_mask=None,
    )


def _ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bool # [nq, nk] -> (count # [1, 1, nq] int32, indices # [1, 1, nq, nk] int32): each row's
    chosen columns first, in increasing order (flex's ordered block layout)."""
    nk = blocks.shape[1]
    counts = blocks.sum(1, dtype=torch.int32)
    # chosen columns sort before the others, each set in column order
    key = torch.where(blocks, 0, nk) + torch.arange(nk, device=blocks.device)
    indices = key.argsort(dim=1, stable=True).to(torch.int32)
    return counts[None, None], indices[None, None]


def plan_block_mask(plan: BlockPlan, block: int | None = None):
    """The ``BlockMask`` of ``plan`` at flex blocks of ``block`` tokens (default: the plan's
    own; a multiple of it: ``coarsen``): its partial blocks with the plan's entry predicate,
    its full blocks unmasked, every other block skipped."""
    from torch.nn.attention.flex_attention import BlockMask

    plan = coarsen(plan, block or plan.block_size)
    full = plan.full if plan.full is not None else torch.zeros_like(plan.blocks)
    partial = plan.blocks & ~full
    counts, indices = _ordered(partial)
    full_counts, full_indices = _ordered(full)  # a plan's full blocks are among its blocks

    def mask_mod(b, h, q_idx, kv_idx):
        return plan.allowed(q_idx, kv_idx)

    return BlockMask.from_kv_blocks(
        counts,
        indices,
        full_counts,
        full_indices,
        BLOCK_SIZE=plan.block_size,
        mask_mod=mask_mod,
        seq_lengths=(plan.sq, plan.sk),
    )


@functools.cache
def _compiled():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _flex(q, k, v, block_mask, scale: float) -> torch.Tensor:
    if q.device.type == "cuda":
        return _compiled()(q, k, v, block_mask=block_mask, scale=scale)
    from torch.nn.attention.flex_attention import flex_attention

    with warnings.catch_warnings():  # eager flex warns that it is unfused: known, and CPU only
        warnings.simplefilter("ignore", UserWarning)
        return flex_attention(q, k, v, block_mask=block_mask, scale=scale)


def flex_plan_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plans: list[BlockPlan],
    *,
    scale: float,
) -> torch.Tensor:
    """Attention of q # [b, n, sq, d] over k, v # [b, n, sk, d] (heads expanded) under ``plans``
    (one per sample, or one for every sample), as ``block_sparse_attention``: # [b, n, sq, d] in
    q's dtype, 0 for a row with no allowed key."""
    if len(plans) not in (1, q.shape[0]):
        raise ValueError(f"plans must hold 1 or {q.shape[0]} (batch) plans, got {len(plans)}")
    outs = []
    for i, plan in enumerate(plans):
        sl = slice(None) if len(plans) == 1 else slice(i, i + 1)
        if plan.flex_mask is None:  # kept with the plan: a cached plan's mask is built once
            plan.flex_mask = plan_block_mask(plan, flex_block(plan.block_size))
        out = _flex(q[sl], k[sl], v[sl], plan.flex_mask, scale)
        outs.append(out)
    return outs[0] if len(outs) == 1 else torch.cat(outs)

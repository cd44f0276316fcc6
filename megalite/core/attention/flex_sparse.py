"""A ``BlockPlan`` run by PyTorch's ``flex_attention``: the fused kernel on CUDA.

    out = flex_plan_attention(q, k, v, plans, scale=scale)     # as block_sparse_attention

The plan already says which key blocks each query block needs (``blocks``) and which of them need
no entry mask (``full``); ``plan_block_mask`` hands exactly those to flex as a ``BlockMask``
(partial blocks with the plan's own entry predicate as ``mask_mod``, full blocks without), so the
kernel visits the blocks the block path computes and no others. On CUDA the kernel is
``torch.compile``'d flex attention (Triton, forward and backward fused, no gathered K/V); on CPU
flex runs eagerly (a dense reference: correct, not fast), which is how CI checks it. The block
path (``block_sparse``) stays the reference and the context-parallel ring's kernel: this path
returns no log-sum-exp to merge. The plan's block size is flex's sparse block size: on CUDA it
must be a multiple of the kernel's tiles (128 is flex's own default).
"""

from __future__ import annotations

import functools
import warnings

import torch

from megalite.core.attention.masks import BlockPlan


def flex_available() -> bool:
    """Whether this torch has flex attention (2.5 and later)."""
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


# flex's kernels tile a sparse block by 128 (forward) and by 64 or 128 (backward) on CUDA
FLEX_BLOCK_MULTIPLE = 128


def flex_serves(q: torch.Tensor, plans: list[BlockPlan]) -> bool:
    """Whether ``flex_plan_attention`` runs ``plans`` here: CUDA, flex present, and every plan's
    block a multiple of ``FLEX_BLOCK_MULTIPLE`` (``--attention-block-size``); else the block path
    does (CPU, where flex has no fused kernel and no backward)."""
    return (
        q.is_cuda
        and flex_available()
        and all(p.block_size % FLEX_BLOCK_MULTIPLE == 0 for p in plans)
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


def plan_block_mask(plan: BlockPlan):
    """The ``BlockMask`` of ``plan``: its partial blocks with the plan's entry predicate, its
    full blocks unmasked, every other block skipped."""
    from torch.nn.attention.flex_attention import BlockMask

    full = plan.full if plan.full is not None else torch.zeros_like(plan.blocks)
    partial = plan.blocks & ~full
    counts, indices = _ordered(partial)
    full_counts, full_indices = _ordered(full & plan.blocks)

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
            plan.flex_mask = plan_block_mask(plan)
        out = _flex(q[sl], k[sl], v[sl], plan.flex_mask, scale)
        outs.append(out)
    return outs[0] if len(outs) == 1 else torch.cat(outs)

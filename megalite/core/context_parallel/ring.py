"""Ring attention (``cp_comm_type="p2p"``): queries stay, key/value blocks travel round the ring.

One loop serves every mask; what differs is its ``RingPlan``: per ring step, the blocks this rank
computes against the K/V it holds then, and whether any rank computes at that step. At step i
rank r holds the K/V of rank ``src = (r - i) mod CP``.

The causal plan (``causal_ring_plan``, ``ring_attention``): cp rank r holds chunks ``r`` and
``2CP-1-r`` (``chunking``) of Q, K and V, each ``c`` tokens, and computes only the unmasked blocks::

    i = 0      Q [2c] x KV [2c], causal (own chunks; local order is increasing)
    src < r    Q [2c] x KV first chunk [c], no mask (chunk src precedes both of r's)
    src > r    Q second chunk [c] x KV [2c], no mask (r's first chunk precedes both of src's)

so every rank computes ``2c^2`` score entries per step (step 0: half of ``(2c)^2``): balanced.
Block-sparse plans (``sparse_ring``: windows, layouts, documents) compute a ``BlockPlan`` per
sample instead, and may leave whole steps empty on every rank.

The K/V block moves only towards the next step some rank needs: from step i to the next needed
step j it jumps ``j - i`` ranks (``Ring.exchange``'s distance), so a step no rank needs moves
nothing; with every step needed (causal) it is the neighbour ring. Every rank derives the needed
steps from the plan, so they agree without communicating. The next block's send/recv runs while
the current block computes; partial outputs merge by their log-sum-exp (``block_attention.merge``;
rows no key of a step reaches count as nothing).

Backward runs the same steps: K/V travel again, and each block's dK/dV is added to an accumulator
that travels with its block (same jumps), then jumps home after the last needed step, so every rank
ends with the full grad of its own K/V. Saved per rank: Q, K, V, the output and the log-sum-exp of
its ``s/CP`` tokens (1/CP of the unsplit attention); the extra is the K/V block in flight.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from megalite.core.attention.block_attention import (
    block_backward,
    block_flops,
    block_forward,
    expand_heads,
    merge,
    reduce_heads,
)
from megalite.core.attention.block_sparse import sparse_backward, sparse_forward
from megalite.core.attention.masks import BlockPlan
from megalite.core.context_parallel.comm import CommStats, Ring, Timer
from megalite.core.groups import group_rank, group_size

_KV_TAG, _BWD_KV_TAG, _DKV_TAG = 71, 72, 73
_ALL = slice(None)


class RingBlock(NamedTuple):
    """Queries ``q[samples, :, queries]`` against keys ``kv[samples, :, keys]`` of the K/V held:
    dense (``causal`` or no mask) or, with ``sparse``, only that plan's blocks."""

    samples: slice = _ALL
    queries: slice = _ALL
    keys: slice = _ALL
    causal: bool = False
    sparse: BlockPlan | None = None


@dataclass(frozen=True)
class RingPlan:
    """``blocks[i]``: what this rank computes at step i; ``needed[i]``: some rank computes at step
    i (the same on every rank; step 0 holds the own K/V and is always run)."""

    blocks: tuple[tuple[RingBlock, ...], ...]
    needed: tuple[bool, ...]

    def steps(self) -> list[int]:
        return [0] + [i for i in range(1, len(self.needed)) if self.needed[i]]


def causal_ring_plan(rank: int, size: int, c: int) -> RingPlan:
    """The causal chunk rule's plan (module docstring) for cp rank ``rank`` of ``size``, chunks of
    ``c`` tokens: every step needed."""
    blocks = []
    for step in range(size):
        src = (rank - step) % size
        if step == 0:
            blocks.append((RingBlock(causal=True),))
        elif src < rank:
            blocks.append((RingBlock(keys=slice(0, c)),))
        else:
            blocks.append((RingBlock(queries=slice(c, None)),))
    return RingPlan(tuple(blocks), (True,) * size)


def _index(block: RingBlock) -> tuple[tuple, tuple]:
    """(query index, key index) into # [b, n|g, s, d]."""
    return (block.samples, _ALL, block.queries), (block.samples, _ALL, block.keys)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, plan, scale, heads_per_group, dropout_p, seed, stats):
        ring, hpg = Ring(group, stats), heads_per_group
        steps = plan.steps()
        kv = torch.stack((k, v)).contiguous()  # [2, b, g, s/cp, d]
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:3], -torch.inf, dtype=torch.float32, device=q.device)
        for j, step in enumerate(steps):
            requests = []
            if j + 1 < len(steps):  # the next needed block travels while this one computes
                incoming = torch.empty_like(kv)
                hop = steps[j + 1] - step
                requests = ring.exchange(
                    kv, incoming, tag=_KV_TAG, distance=hop, what="keys and values (forward)"
                )
            src = (ring.rank - step) % ring.size
            with Timer(stats):
                for block in plan.blocks[step]:
                    qi, ki = _index(block)
                    kk, vv = expand_heads(kv[0][ki], hpg), expand_heads(kv[1][ki], hpg)
                    if block.sparse is not None:
                        o, o_lse = sparse_forward(q[qi], kk, vv, block.sparse, scale=scale)
                    else:
                        o, o_lse = block_forward(
                            q[qi],
                            kk,
                            vv,
                            causal=block.causal,
                            scale=scale,
                            dropout_p=dropout_p,
                            seed=seed + ring.rank * ring.size + src,
                        )
                        if stats is not None:
                            b, n, qs, d = o.shape
                            stats.flops += block_flops(
                                b, n, qs, kk.shape[2], d, causal=block.causal
                            )
                    out[qi], lse[qi] = merge(out[qi], lse[qi], o, o_lse)
            if requests:
                ring.wait(requests)
                kv = incoming
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.plan, ctx.scale, ctx.heads_per_group = group, plan, scale, heads_per_group
        ctx.dropout_p, ctx.seed, ctx.stats = dropout_p, seed, stats
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, hpg, plan = Ring(ctx.group, ctx.stats), ctx.heads_per_group, ctx.plan
        steps = plan.steps()
        dout = dout.contiguous()
        dq = torch.zeros_like(q, dtype=torch.float32)
        kv = torch.stack((k, v)).contiguous()  # [2, b, g, s/cp, d]
        dkv, dkv_requests, dkv_in = None, [], None
        for j, step in enumerate(steps):
            # to the holder of this block at the next needed step, or home after the last
            hop = (steps[j + 1] if j + 1 < len(steps) else ring.size) - step
            requests = []
            if j + 1 < len(steps):
                incoming = torch.empty_like(kv)
                requests = ring.exchange(
                    kv, incoming, tag=_BWD_KV_TAG, distance=hop, what="keys and values (backward)"
                )
            src = (ring.rank - step) % ring.size
            own = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
            with Timer(ctx.stats):
                for block in plan.blocks[step]:
                    qi, ki = _index(block)
                    args = (dout[qi], q[qi], expand_heads(kv[0][ki], hpg))
                    args += (expand_heads(kv[1][ki], hpg), out[qi], lse[qi])
                    if block.sparse is not None:
                        dq_b, dk_b, dv_b = sparse_backward(*args, block.sparse, scale=ctx.scale)
                    else:
                        dq_b, dk_b, dv_b = block_backward(
                            *args,
                            causal=block.causal,
                            scale=ctx.scale,
                            dropout_p=ctx.dropout_p,
                            seed=ctx.seed + ring.rank * ring.size + src,
                        )
                    dq[qi] += dq_b
                    own[0][ki] += reduce_heads(dk_b, hpg)
                    own[1][ki] += reduce_heads(dv_b, hpg)
            if dkv_requests:  # the accumulator of the block held now, from its previous holder
                ring.wait(dkv_requests)
                own += dkv_in
            dkv = own
            if hop < ring.size:  # pass it on (a jump of CP ranks: it is home already)
                dkv_in = torch.empty_like(dkv)
                dkv_requests = ring.exchange(
                    dkv, dkv_in, tag=_DKV_TAG, distance=hop, what="key and value grads"
                )
            else:
                dkv_requests = []
            if requests:
                ring.wait(requests)
                kv = incoming
        if dkv_requests:  # after the last jump the accumulator of our own block is complete
            ring.wait(dkv_requests)
            dkv = dkv_in
        dk, dv = dkv[0].to(k.dtype), dkv[1].to(v.dtype)
        return dq.to(q.dtype), dk, dv, None, None, None, None, None, None, None


def run_ring(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: RingPlan,
    *,
    cp_group,
    scale: float,
    dropout_p: float = 0.0,
    stats: CommStats | None = None,
) -> torch.Tensor:
    """The ring loop under ``plan``: q # [b, n, s/cp, d]; k, v # [b, g, s/cp, d] (``n % g == 0``,
    GQA: query head j*k+i reads group j). Returns # [b, n, s/cp, d]. Dropout (dense blocks) acts on
    the probabilities with one mask per block (seeded from the current RNG state)."""
    n, g = q.shape[1], k.shape[1]
    seed = int(torch.randint(0, 2**40, (1,)).item()) if dropout_p > 0.0 else 0
    return _RingAttention.apply(q, k, v, cp_group, plan, scale, n // g, dropout_p, seed, stats)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    cp_group,
    scale: float,
    dropout_p: float = 0.0,
    stats: CommStats | None = None,
) -> torch.Tensor:
    """Causal attention of this rank's two chunks over the whole sequence held by ``cp_group``.

    q # [b, n, s/cp, d]; k, v # [b, g, s/cp, d], all in the local chunk order. Returns the context
    # [b, n, s/cp, d]."""
    plan = causal_ring_plan(group_rank(cp_group), group_size(cp_group), q.shape[2] // 2)
    return run_ring(q, k, v, plan, cp_group=cp_group, scale=scale, dropout_p=dropout_p, stats=stats)

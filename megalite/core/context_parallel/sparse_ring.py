"""Ring attention (``cp_comm_type="p2p"``) under any block mask: windows, sparse layouts, documents.

As in ``ring``, K/V blocks travel round the cp ring while queries stay; at step i this rank holds
the K/V of rank ``src = (r - i) mod CP``. Instead of the causal chunk rule, step i computes the
blocks of ``plans[src]``: the block plan (``core.attention.masks``) of this rank's query positions
(and documents) against ``src``'s key positions; a step whose plan keeps no block computes nothing
(the K/V still pass on). Partial results merge by their log-sum-exp, rows that no key of a step
reaches counting as nothing. Backward runs the ring again with dK/dV accumulators travelling with
their blocks, as in ``ring``. Saved: q, k, v, out and lse of the local tokens.
"""

from __future__ import annotations

import torch

from megalite.core.attention.block_sparse import sparse_backward, sparse_forward
from megalite.core.attention.masks import BlockPlan
from megalite.core.context_parallel.block_attention import expand_heads, reduce_heads
from megalite.core.context_parallel.comm import CommStats, Ring

_KV_TAG, _BWD_KV_TAG, _DKV_TAG = 81, 82, 83


def _merge(out, lse, block_out, block_lse):
    """``block_attention.merge`` where either side (or both) may be -inf (no key reached)."""
    new = torch.logaddexp(lse, block_lse)
    fin = new.masked_fill(new == -torch.inf, 0.0)
    out = out * torch.exp(lse - fin).unsqueeze(-1) + block_out * torch.exp(
        block_lse - fin
    ).unsqueeze(-1)
    return out, new


def _samples(plans: list[BlockPlan]):
    for i, plan in enumerate(plans):
        if plan.num_computed:
            yield (slice(None) if len(plans) == 1 else slice(i, i + 1)), plan


class _SparseRingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, plans, scale, heads_per_group, stats):
        ring = Ring(group, stats)
        kv = torch.stack((k, v)).contiguous()  # [2, b, g, s/cp, d]
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:3], -torch.inf, dtype=torch.float32, device=q.device)
        for step in range(ring.size):
            requests = []
            if step + 1 < ring.size:
                incoming = torch.empty_like(kv)
                requests = ring.exchange(kv, incoming, tag=_KV_TAG)
            src = (ring.rank - step) % ring.size
            for sl, plan in _samples(plans[src]):
                kk = expand_heads(kv[0][sl], heads_per_group)
                vv = expand_heads(kv[1][sl], heads_per_group)
                o, o_lse = sparse_forward(q[sl], kk, vv, plan, scale=scale)
                out[sl], lse[sl] = _merge(out[sl], lse[sl], o, o_lse)
            if requests:
                ring.wait(requests)
                kv = incoming
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.plans, ctx.scale = group, plans, scale
        ctx.heads_per_group, ctx.stats = heads_per_group, stats
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, hpg = Ring(ctx.group, ctx.stats), ctx.heads_per_group
        dout = dout.contiguous()
        dq = torch.zeros_like(q, dtype=torch.float32)
        kv = torch.stack((k, v)).contiguous()
        dkv_requests, dkv_in = [], None
        for step in range(ring.size):
            requests = []
            if step + 1 < ring.size:
                incoming = torch.empty_like(kv)
                requests = ring.exchange(kv, incoming, tag=_BWD_KV_TAG)
            src = (ring.rank - step) % ring.size
            own = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
            for sl, plan in _samples(ctx.plans[src]):
                args = (dout[sl], q[sl], expand_heads(kv[0][sl], hpg))
                args += (expand_heads(kv[1][sl], hpg), out[sl], lse[sl], plan)
                dq_b, dk_b, dv_b = sparse_backward(*args, scale=ctx.scale)
                dq[sl] += dq_b
                own[0][sl] = reduce_heads(dk_b, hpg)
                own[1][sl] = reduce_heads(dv_b, hpg)
            if dkv_requests:  # the accumulator of the block held now, from the previous rank
                ring.wait(dkv_requests)
                own += dkv_in
            dkv = own
            if ring.size > 1:
                dkv_in = torch.empty_like(dkv)
                dkv_requests = ring.exchange(dkv, dkv_in, tag=_DKV_TAG)
            if requests:
                ring.wait(requests)
                kv = incoming
        if dkv_requests:
            ring.wait(dkv_requests)
            dkv = dkv_in
        dk, dv = dkv[0].to(k.dtype), dkv[1].to(v.dtype)
        return dq.to(q.dtype), dk, dv, None, None, None, None, None


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
    """Attention of this rank's tokens over the whole sequence held by ``cp_group``, computing
    only the blocks of ``plans[src]`` (per sample, or one for every sample) against cp rank
    ``src``'s keys. q # [b, n, s/cp, d]; k, v # [b, g, s/cp, d]. Returns # [b, n, s/cp, d]."""
    n, g = q.shape[1], k.shape[1]
    return _SparseRingAttention.apply(q, k, v, cp_group, plans, scale, n // g, stats)

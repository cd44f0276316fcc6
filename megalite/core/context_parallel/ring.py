"""Ring attention (``cp_comm_type="p2p"``): queries stay, key/value blocks travel round the ring.

Cp rank r holds chunks ``r`` and ``2CP-1-r`` (``chunking``) of Q, K and V, each ``c`` tokens. At
step i it holds the K/V of rank ``src = (r - i) mod CP`` and, under the causal mask, computes only
the unmasked blocks::

    i = 0      Q [2c] x KV [2c], causal (own chunks; local order is increasing)
    src < r    Q [2c] x KV first chunk [c], no mask (chunk src precedes both of r's)
    src > r    Q second chunk [c] x KV [2c], no mask (r's first chunk precedes both of src's)

so every rank computes ``2c^2`` score entries per step (step 0: half of ``(2c)^2``): balanced.
The next K/V block's send/recv runs while the current block computes; the partial outputs merge
by their log-sum-exp (``block_attention.merge``).

Backward runs the same ring: K/V travel again, and each block's dK/dV is added to an accumulator
that travels with it, so after CP steps plus one send every rank holds the full grad of its own
K/V. Saved per rank: Q, K, V, the output and the log-sum-exp of its ``s/CP`` tokens (1/CP of the
unsplit attention); the extra is the K/V block in flight (``2 x`` the local K/V during forward).
"""

from __future__ import annotations

import torch

from megalite.core.context_parallel.block_attention import (
    block_backward,
    block_flops,
    block_forward,
    expand_heads,
    merge,
    reduce_heads,
)
from megalite.core.context_parallel.comm import CommStats, Ring, Timer

_KV_TAG, _BWD_KV_TAG, _DKV_TAG = 71, 72, 73


def _block_plan(step: int, src: int, rank: int, c: int) -> tuple[slice, slice, bool]:
    """(query rows, key columns, causal) that rank ``rank`` computes against ``src``'s K/V."""
    if step == 0:
        return slice(None), slice(None), True
    if src < rank:
        return slice(None), slice(0, c), False
    return slice(c, None), slice(None), False


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, scale, heads_per_group, dropout_p, seed, stats):
        ring = Ring(group, stats)
        b, n, s_local, d = q.shape
        c = s_local // 2
        kv = torch.stack((k, v)).contiguous()  # [2, b, g, 2c, d]
        out = torch.empty(b, n, s_local, d, dtype=torch.float32, device=q.device)
        lse = torch.empty(b, n, s_local, dtype=torch.float32, device=q.device)
        for step in range(ring.size):
            requests = []
            if step + 1 < ring.size:  # the next block travels while this one computes
                incoming = torch.empty_like(kv)
                requests = ring.exchange(kv, incoming, tag=_KV_TAG)
            src = (ring.rank - step) % ring.size
            rows, cols, causal = _block_plan(step, src, ring.rank, c)
            with Timer(stats):
                kk = expand_heads(kv[0][:, :, cols], heads_per_group)
                vv = expand_heads(kv[1][:, :, cols], heads_per_group)
                o, o_lse = block_forward(
                    q[:, :, rows],
                    kk,
                    vv,
                    causal=causal,
                    scale=scale,
                    dropout_p=dropout_p,
                    seed=seed + ring.rank * ring.size + src,
                )
                if step == 0:
                    out.copy_(o)
                    lse.copy_(o_lse)
                else:
                    out[:, :, rows], lse[:, :, rows] = merge(
                        out[:, :, rows], lse[:, :, rows], o, o_lse
                    )
            if stats is not None:
                qs, ks = o.shape[2], kk.shape[2]
                stats.flops += block_flops(b, n, qs, ks, d, causal=causal)
            if requests:
                ring.wait(requests)
                kv = incoming
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.scale, ctx.heads_per_group = group, scale, heads_per_group
        ctx.dropout_p, ctx.seed, ctx.stats = dropout_p, seed, stats
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring = Ring(ctx.group, ctx.stats)
        hpg, c = ctx.heads_per_group, q.shape[2] // 2
        dout = dout.contiguous()
        dq = torch.zeros_like(q, dtype=torch.float32)
        kv = torch.stack((k, v)).contiguous()  # [2, b, g, 2c, d]
        dkv, dkv_requests, dkv_in = None, [], None
        for step in range(ring.size):
            requests = []
            if step + 1 < ring.size:
                incoming = torch.empty_like(kv)
                requests = ring.exchange(kv, incoming, tag=_BWD_KV_TAG)
            src = (ring.rank - step) % ring.size
            rows, cols, causal = _block_plan(step, src, ring.rank, c)
            with Timer(ctx.stats):
                dq_b, dk_b, dv_b = block_backward(
                    dout[:, :, rows],
                    q[:, :, rows],
                    expand_heads(kv[0][:, :, cols], hpg),
                    expand_heads(kv[1][:, :, cols], hpg),
                    out[:, :, rows],
                    lse[:, :, rows],
                    causal=causal,
                    scale=ctx.scale,
                    dropout_p=ctx.dropout_p,
                    seed=ctx.seed + ring.rank * ring.size + src,
                )
                dq[:, :, rows] += dq_b
                own = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
                own[0][:, :, cols] = reduce_heads(dk_b, hpg)
                own[1][:, :, cols] = reduce_heads(dv_b, hpg)
            if dkv_requests:  # the accumulator of the block held now, from the previous rank
                ring.wait(dkv_requests)
                own += dkv_in
            dkv = own
            if ring.size > 1:  # pass it on; receive the accumulator of the next block
                dkv_in = torch.empty_like(dkv)
                dkv_requests = ring.exchange(dkv, dkv_in, tag=_DKV_TAG)
            if requests:
                ring.wait(requests)
                kv = incoming
        if dkv_requests:  # after CP steps the accumulator of our own block is complete
            ring.wait(dkv_requests)
            dkv = dkv_in
        dk, dv = dkv[0].to(k.dtype), dkv[1].to(v.dtype)
        return dq.to(q.dtype), dk, dv, None, None, None, None, None, None


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

    q # [b, n, s/cp, d]; k, v # [b, g, s/cp, d] with ``n % g == 0`` (GQA: query head j*k+i reads
    group j), all in the local chunk order. Returns the context # [b, n, s/cp, d]. Dropout acts on
    the probabilities with one mask per block (seeded from the current RNG state)."""
    n, g = q.shape[1], k.shape[1]
    seed = int(torch.randint(0, 2**40, (1,)).item()) if dropout_p > 0.0 else 0
    return _RingAttention.apply(q, k, v, cp_group, scale, n // g, dropout_p, seed, stats)

"""All-gather attention (``--cp-comm-type all_gather``): every rank gathers the whole sequence's
K/V and attends its own two query chunks to it.

Query chunk j (of ``2 x CP``, ``c`` tokens) attends keys ``[0, (j+1) c)`` with the causal mask
aligned bottom-right, so keys past its last token are never computed. Forward all-gathers the
local K/V (each rank sends ``(CP-1) x`` its K/V), backward reduce-scatters their grads (the same
volume). Saved per rank: the gathered K/V (``CP x`` the local K/V) and each chunk's attention.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megalite.core.context_parallel.block_attention import block_flops, expand_heads
from megalite.core.context_parallel.chunking import cp_chunk_ids, rank_major_to_natural
from megalite.core.context_parallel.comm import CommStats, WaitTimer, nbytes
from megalite.core.tensor_parallel.mappings import group_rank, group_size, reduce_scatter_tensor


class _GatherSequence(torch.autograd.Function):
    """Forward: all-gather over ``group`` along dim -2 (rank order). Backward: reduce-scatter (sum
    over ranks of the grad of each rank's piece)."""

    @staticmethod
    def forward(ctx, x, group, stats):
        ctx.group, ctx.stats = group, stats
        size = group_size(group)
        pieces = [torch.empty_like(x) for _ in range(size)]
        with WaitTimer(stats):
            dist.all_gather(pieces, x.contiguous(), group=group)
        if stats is not None:
            stats.bytes_sent += (size - 1) * nbytes(x)
        return torch.cat(pieces, dim=-2)

    @staticmethod
    def backward(ctx, grad):
        size = group_size(ctx.group)
        send = torch.stack(grad.chunk(size, dim=-2)).contiguous()  # [cp, ...]
        out = torch.empty_like(send[0])
        with WaitTimer(ctx.stats):
            reduce_scatter_tensor(out.view(-1), send.view(-1), ctx.group)
        if ctx.stats is not None:
            ctx.stats.bytes_sent += (size - 1) * nbytes(out)
        return out, None, None


def all_gather_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    cp_group,
    scale: float,
    dropout_p: float = 0.0,
    stats: CommStats | None = None,
) -> torch.Tensor:
    """q # [b, n, s/cp, d]; k, v # [b, g, s/cp, d] in the local chunk order. Returns the causal
    context # [b, n, s/cp, d]."""
    cp, rank = group_size(cp_group), group_rank(cp_group)
    b, n, s_local, d = q.shape
    s, c = s_local * cp, s_local // 2
    kv = torch.stack((k, v))  # [2, b, g, s/cp, d]
    if cp > 1:
        kv = _GatherSequence.apply(kv, cp_group, stats)
        kv = kv.index_select(-2, rank_major_to_natural(s, cp).to(q.device))  # [2, b, g, s, d]
    hpg = n // k.shape[1]
    outs = []
    for half, j in enumerate(cp_chunk_ids(cp, rank)):
        end = (j + 1) * c  # the chunk sees keys [0, end)
        q_j = q[:, :, half * c : (half + 1) * c]
        k_j, v_j = (expand_heads(t[:, :, :end], hpg) for t in kv.unbind(0))
        mask = torch.ones(c, end, dtype=torch.bool, device=q.device).tril(end - c)
        outs.append(
            F.scaled_dot_product_attention(
                q_j, k_j, v_j, attn_mask=mask, dropout_p=dropout_p, scale=scale
            )
        )
        if stats is not None:
            stats.flops += block_flops(b, n, c, end - c, d, causal=False)
            stats.flops += block_flops(b, n, c, c, d, causal=True)
    return torch.cat(outs, dim=2)

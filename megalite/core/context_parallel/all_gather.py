"""All-gather attention (``cp_comm_type="all_gather"``): every rank gathers the whole sequence's
K/V and attends its own two query chunks to it.

Query chunk j (of ``2 x CP``, ``c`` tokens) attends keys ``[0, j c)`` unmasked and its own chunk
``[j c, (j+1) c)`` causally (the ring's blocks, merged by log-sum-exp), so keys past its last token
are never computed. Forward all-gathers the local K/V (each rank sends ``(CP-1) x`` its K/V),
backward reduce-scatters their grads (the same volume). Saved per rank: q, the gathered K/V
(``CP x`` the local K/V; reordered, so twice that at most), the output and the log-sum-exp.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megalite.core.attention.block_attention import (
    block_backward,
    block_flops,
    block_forward,
    expand_heads,
    merge,
    reduce_heads,
)
from megalite.core.context_parallel.chunking import cp_chunk_ids, rank_major_to_natural
from megalite.core.context_parallel.comm import CommStats, Timer, WaitTimer, nbytes
from megalite.core.groups import group_rank, group_size, reduce_scatter_tensor
from megalite.core.op_record import RECORDER


class _GatherSequence(torch.autograd.Function):
    """Forward: all-gather over ``group`` along dim -2 (rank order). Backward: reduce-scatter (sum
    over ranks of the grad of each rank's piece)."""

    @staticmethod
    def forward(ctx, x, group, stats):
        ctx.group, ctx.stats = group, stats
        size = group_size(group)
        pieces = [torch.empty_like(x) for _ in range(size)]
        with WaitTimer(stats):
            rec = RECORDER.begin(
                "all_gather", group=group, axis="cp", what="keys and values", shape=x.shape
            )
            dist.all_gather(pieces, x.contiguous(), group=group)
            RECORDER.end(rec)
        if stats is not None:
            stats.bytes_sent += (size - 1) * nbytes(x)
        return torch.cat(pieces, dim=-2)

    @staticmethod
    def backward(ctx, grad):
        size = group_size(ctx.group)
        send = torch.stack(grad.chunk(size, dim=-2)).contiguous()  # [cp, ...]
        out = torch.empty_like(send[0])
        with WaitTimer(ctx.stats):
            reduce_scatter_tensor(
                out.view(-1), send.view(-1), ctx.group, what="key and value grads"
            )
        if ctx.stats is not None:
            ctx.stats.bytes_sent += (size - 1) * nbytes(out)
        return out, None, None


class _PrefixAttention(torch.autograd.Function):
    """Each local query chunk j against the gathered K/V: keys ``[0, j c)`` with no mask, then
    ``[j c, (j+1) c)`` causal, merged by log-sum-exp; backward per block from the merged output
    (``block_attention``). Saves q, the gathered K/V, the output and the log-sum-exp."""

    @staticmethod
    def forward(ctx, q, kv, chunk_ids, scale, heads_per_group, dropout_p, seed, stats):
        c = q.shape[2] // 2
        outs, lses = [], []
        for half, j in enumerate(chunk_ids):
            q_j = q[:, :, half * c : (half + 1) * c]
            out = lse = None
            for start, end, causal in _blocks(j, c):
                k_b, v_b = (expand_heads(t[:, :, start:end], heads_per_group) for t in kv.unbind(0))
                with Timer(stats):
                    o, o_lse = block_forward(
                        q_j,
                        k_b,
                        v_b,
                        causal=causal,
                        scale=scale,
                        dropout_p=dropout_p,
                        seed=seed + 2 * j + causal,
                    )
                    out, lse = (o.float(), o_lse) if out is None else merge(out, lse, o, o_lse)
                if stats is not None:
                    stats.flops += block_flops(
                        *q_j.shape[:3], end - start, q.shape[3], causal=causal
                    )
            outs.append(out)
            lses.append(lse)
        out, lse = torch.cat(outs, dim=2).to(q.dtype), torch.cat(lses, dim=2)
        ctx.save_for_backward(q, kv, out, lse)
        ctx.args = (chunk_ids, scale, heads_per_group, dropout_p, seed, stats)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, kv, out, lse = ctx.saved_tensors
        chunk_ids, scale, hpg, dropout_p, seed, stats = ctx.args
        c = q.shape[2] // 2
        dq = torch.zeros_like(q, dtype=torch.float32)
        dkv = torch.zeros_like(kv, dtype=torch.float32)
        dout = dout.contiguous()
        for half, j in enumerate(chunk_ids):
            rows = slice(half * c, (half + 1) * c)
            for start, end, causal in _blocks(j, c):
                k_b, v_b = (expand_heads(t[:, :, start:end], hpg) for t in kv.unbind(0))
                with Timer(stats):
                    dq_b, dk_b, dv_b = block_backward(
                        dout[:, :, rows],
                        q[:, :, rows],
                        k_b,
                        v_b,
                        out[:, :, rows],
                        lse[:, :, rows],
                        causal=causal,
                        scale=scale,
                        dropout_p=dropout_p,
                        seed=seed + 2 * j + causal,
                    )
                    dq[:, :, rows] += dq_b
                    dkv[0][:, :, start:end] += reduce_heads(dk_b, hpg)
                    dkv[1][:, :, start:end] += reduce_heads(dv_b, hpg)
        return dq.to(q.dtype), dkv.to(kv.dtype), None, None, None, None, None, None


def _blocks(j: int, c: int) -> list[tuple[int, int, bool]]:
    """Key blocks (start, end, causal) that query chunk ``j`` sees: its full prefix, then its own
    chunk under the causal mask."""
    return ([(0, j * c, False)] if j else []) + [(j * c, (j + 1) * c, True)]


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
    s = q.shape[2] * cp
    kv = torch.stack((k, v))  # [2, b, g, s/cp, d]
    if cp > 1:
        kv = _GatherSequence.apply(kv, cp_group, stats)
        kv = kv.index_select(-2, rank_major_to_natural(s, cp).to(q.device))  # [2, b, g, s, d]
    seed = int(torch.randint(0, 2**40, (1,)).item()) if dropout_p > 0.0 else 0
    return _PrefixAttention.apply(
        q, kv, cp_chunk_ids(cp, rank), scale, q.shape[1] // k.shape[1], dropout_p, seed, stats
    )

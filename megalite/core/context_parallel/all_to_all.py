"""All-to-all attention (``cp_comm_type="a2a"``, DeepSpeed-Ulysses): trade the sequence split for
a head split, attend over the whole sequence locally, trade back.

    [b, n, s/cp, d]  (all-to-all) ->  [b, n/cp, s, d]  (attention, all-to-all) ->  [b, n, s/cp, d]

The gathered sequence arrives in rank-major chunk order and is put in natural order before the
(ordinary, causal) attention and back after, so any attention backend runs unchanged. K/V travel
as query groups when the local groups divide by CP, else expanded to heads first. Each rank sends
``(CP-1)/CP`` of its Q, K, V and output: ``4 x (CP-1)/CP x b s/cp h`` elements per layer forward
(with GQA K/V are smaller), the same again in backward, independent of the ring's CP steps.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megalite.core.attention.block_attention import expand_heads
from megalite.core.context_parallel.chunking import rank_major_to_natural
from megalite.core.context_parallel.comm import CommStats, WaitTimer, nbytes
from megalite.core.groups import all_to_all_tensor, group_size


def _all_to_all(x: torch.Tensor, group, scatter_dim: int, gather_dim: int, stats) -> torch.Tensor:
    size = group_size(group)
    if size == 1:
        return x
    send = torch.stack(x.chunk(size, dim=scatter_dim)).contiguous()  # [cp, ...] piece i -> rank i
    recv = torch.empty_like(send)
    with WaitTimer(stats):  # blocking: all of it is waiting
        all_to_all_tensor(recv, send, None, None, group, what="attention (cp all-to-all)")
    if stats is not None:
        stats.bytes_sent += nbytes(send) * (size - 1) // size
    return torch.cat(recv.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim, stats):
        ctx.group, ctx.dims, ctx.stats = group, (scatter_dim, gather_dim), stats
        return _all_to_all(x, group, scatter_dim, gather_dim, stats)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return (
            _all_to_all(grad, ctx.group, gather_dim, scatter_dim, ctx.stats),
            None,
            None,
            None,
            None,
        )


def all_to_all(
    x: torch.Tensor, group, *, scatter_dim: int, gather_dim: int, stats: CommStats | None = None
) -> torch.Tensor:
    """Forward: split ``x`` along ``scatter_dim`` into ``cp`` pieces, send piece i to rank i and
    concatenate the received pieces (rank order) along ``gather_dim``. Backward: the inverse
    all-to-all (scatter ``gather_dim``, gather ``scatter_dim``)."""
    return _AllToAll.apply(x, group, scatter_dim, gather_dim, stats)


def all_to_all_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    cp_group,
    core_attention: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    stats: CommStats | None = None,
) -> torch.Tensor:
    """q # [b, n, s/cp, d]; k, v # [b, g, s/cp, d] in the local chunk order (``n`` must divide by
    CP). ``core_attention(q, k, v)`` is the ordinary causal attention on # [b, n/cp, s, d] with k/v
    expanded to heads. Returns # [b, n, s/cp, d]."""
    cp = group_size(cp_group)
    n, g = q.shape[1], k.shape[1]
    if n % cp:
        raise ValueError(
            f"{n} local attention heads are not divisible by context_parallel_size {cp}"
        )
    if g % cp:  # groups cannot be split: send heads
        k, v = expand_heads(k, n // g), expand_heads(v, n // g)
    s = q.shape[2] * cp
    perm = rank_major_to_natural(s, cp).to(q.device)
    back = perm.argsort()

    def to_heads(x):  # [b, ., s/cp, d] -> [b, ./cp, s, d] in natural order
        return all_to_all(x, cp_group, scatter_dim=1, gather_dim=2, stats=stats).index_select(
            2, perm
        )

    qh, kh, vh = to_heads(q), to_heads(k), to_heads(v)
    hpg = qh.shape[1] // kh.shape[1]
    out = core_attention(qh, expand_heads(kh, hpg), expand_heads(vh, hpg))  # [b, n/cp, s, d]
    return all_to_all(out.index_select(2, back), cp_group, scatter_dim=2, gather_dim=1, stats=stats)

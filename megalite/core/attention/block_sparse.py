"""Block-sparse attention: compute only the blocks a ``BlockPlan`` keeps, with the exact softmax.

For each group of query blocks that need the same number c of key blocks, the queries
# [b*n, R, B, d] meet their keys and values # [b*n, R, c*B, d] in one call of the block kernel
(``block_attention``: the CPU flash kernel with the entry mask, else the matmul block), which
returns the rows' output and log-sum-exp. Every row sees all its key blocks in one call, so its
softmax is exact; a group is cut into calls of at most ``max_entries`` score entries to bound
transient memory (``BlockPlan.calls``, built once per plan). A plain causal window over a whole
sequence (``BlockPlan.band``) runs ``band_attention`` instead (whole tiles, no gathered keys).
Elsewhere (documents, context-parallel chunks) a window's band of key blocks is an overlapping
strided view (no copy), other layouts one gather per call; the entry mask is one ``[B, c*B]``
mask shared by the call's rows where they agree (windows and layouts away from the sequence's
ends), none where every entry is allowed, and per row only where the rows differ (documents, a
short last block). The (out, lse) pair merges with other partial results by
``block_attention.merge`` (the context-parallel ring does).

Backward recomputes each call's probabilities from the saved FINAL ``out`` and ``lse`` (flash
attention's identity), so the saved state is q, k, v, out and lse: O(s), plus the plan (O(computed
blocks)); dK and dV are added back by slices (a band) or ``index_add_``.
"""

from __future__ import annotations

import torch

from megalite.core.attention.band_attention import band_backward, band_blocks, band_forward
from megalite.core.attention.block_attention import block_backward, block_forward
from megalite.core.attention.masks import BlockCall, BlockPlan

# Score entries per kernel call (bounds the gathered K/V and the mask held at once).
DEFAULT_MAX_ENTRIES = 1 << 22


def _pad_blocks(x: torch.Tensor, n_blocks: int, b: int) -> torch.Tensor:
    """# [B', H, s, d] -> [B' * H, n_blocks, b, d], zero-padded at the end of s."""
    bh, s = x.shape[0] * x.shape[1], x.shape[2]
    x = x.reshape(bh, s, x.shape[3])
    if n_blocks * b != s:
        x = torch.cat((x, x.new_zeros(bh, n_blocks * b - s, x.shape[2])), dim=1)
    return x.contiguous().view(bh, n_blocks, b, x.shape[2])


def _rows(xb: torch.Tensor, call: BlockCall) -> torch.Tensor:
    """The call's query blocks of ``xb`` # [BH, n, B, d]: a slice when consecutive."""
    if call.row_start is not None:
        return xb[:, call.row_start : call.row_start + call.rows.shape[0]]
    return xb.index_select(1, call.rows)


def _gather(xb: torch.Tensor, call: BlockCall) -> torch.Tensor:
    """The call's key blocks of ``xb`` # [BH, nk, B, d] (contiguous) -> # [BH, R, c * B, d]; a
    band is an overlapping strided view (no copy), anything else one gather."""
    r, c = call.cols.shape
    bh, nk, b, d = xb.shape
    if call.band_start is not None:
        offset = xb.storage_offset() + call.band_start * b * d
        return xb.as_strided((bh, r, c * b, d), (nk * b * d, b * d, d, 1), offset)
    return xb.index_select(1, call.cols.flatten()).view(bh, r, c * b, d)


def _put_rows(acc: torch.Tensor, call: BlockCall, x: torch.Tensor) -> None:
    """``acc[:, rows] = x`` # [BH, R, B, d] (or [BH, R, B])."""
    if call.row_start is not None:
        acc[:, call.row_start : call.row_start + call.rows.shape[0]] = x
    else:
        acc.index_copy_(1, call.rows, x)


def sparse_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: BlockPlan,
    *,
    scale: float,
    max_entries: int = DEFAULT_MAX_ENTRIES,
    computed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q # [b, n, sq, d]; k, v # [b, n, sk, d] (heads expanded; one plan for every sample).
    Returns (out # [b, n, sq, d] fp32, lse # [b, n, sq] fp32; rows with no allowed key: 0, -inf).
    ``computed`` (int # [nq, nk]) counts each block computed, for tests."""
    bsz, n, sq, d = q.shape
    blk = plan.block_size
    if plan.band is not None:  # a plain causal window: by tiles
        if computed is not None:
            computed += band_blocks(plan.band, sq, blk)
        return band_forward(q, k, v, plan.band, scale=scale)
    nq, nk = -(-sq // blk), -(-plan.sk // blk)
    qb, kb, vb = _pad_blocks(q, nq, blk), _pad_blocks(k, nk, blk), _pad_blocks(v, nk, blk)
    out = torch.zeros(bsz * n, nq, blk, d, dtype=torch.float32, device=q.device)
    lse = torch.full((bsz * n, nq, blk), -torch.inf, dtype=torch.float32, device=q.device)
    for call in plan.calls(max_entries):
        o, o_lse = block_forward(
            _rows(qb, call),
            _gather(kb, call),
            _gather(vb, call),
            causal=False,
            scale=scale,
            mask=plan.call_mask(call),
        )
        _put_rows(out, call, o.float())
        _put_rows(lse, call, o_lse)
        if computed is not None:
            rows, cols = call.rows, call.cols
            computed.index_put_((rows[:, None].expand_as(cols), cols), torch.ones_like(cols), True)
    out = out.view(bsz, n, nq * blk, d)[:, :, :sq]
    return out, lse.view(bsz, n, nq * blk)[:, :, :sq]


def sparse_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    plan: BlockPlan,
    *,
    scale: float,
    max_entries: int = DEFAULT_MAX_ENTRIES,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) fp32 of the plan's blocks, given the rows' FINAL ``out`` and ``lse`` (after
    any merge) and ``dout``, all as in ``sparse_forward``."""
    if plan.band is not None:
        return band_backward(dout, q, k, v, out, lse, plan.band, scale=scale)
    bsz, n, sq, d = q.shape
    sk, blk = k.shape[2], plan.block_size
    nq, nk = -(-sq // blk), -(-sk // blk)
    qb, kb, vb = _pad_blocks(q, nq, blk), _pad_blocks(k, nk, blk), _pad_blocks(v, nk, blk)
    ob, dob = _pad_blocks(out.to(q.dtype), nq, blk), _pad_blocks(dout.to(q.dtype), nq, blk)
    lb = _pad_blocks(lse.unsqueeze(-1), nq, blk).squeeze(-1)  # [BH, nq, B]
    dq = torch.zeros(qb.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(kb.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(vb.shape, dtype=torch.float32, device=q.device)
    for call in plan.calls(max_entries):
        r, c = call.cols.shape
        dq_b, dk_b, dv_b = block_backward(
            _rows(dob, call),
            _rows(qb, call),
            _gather(kb, call),
            _gather(vb, call),
            _rows(ob, call),
            _rows(lb, call),
            causal=False,
            scale=scale,
            mask=plan.call_mask(call),
        )
        _put_rows(dq, call, dq_b.float())
        start = call.band_start
        for acc, grad in ((dk, dk_b), (dv, dv_b)):
            if start is not None:  # key block start + i + j of row i: c strided adds
                g = grad.float().reshape(acc.shape[0], r, c, blk, d)
                for j in range(c):
                    acc[:, start + j : start + j + r] += g[:, :, j]
            else:
                acc.index_add_(
                    1, call.cols.flatten(), grad.float().reshape(acc.shape[0], r * c, blk, d)
                )

    def unpad(x, s):
        return x.view(bsz, n, -1, d)[:, :, :s]

    return unpad(dq, sq), unpad(dk, sk), unpad(dv, sk)


def _cat(parts) -> torch.Tensor:
    """The samples' results in one batch (one plan for the batch: no copy)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


class _BlockSparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plans, scale, max_entries):
        outs, lses = [], []
        for i, plan in enumerate(plans):  # one plan per sample, or one for the whole batch
            sl = slice(None) if len(plans) == 1 else slice(i, i + 1)
            o, lse = sparse_forward(q[sl], k[sl], v[sl], plan, scale=scale, max_entries=max_entries)
            outs.append(o)
            lses.append(lse)
        out, lse = _cat(outs).to(q.dtype), _cat(lses)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plans, ctx.scale, ctx.max_entries = plans, scale, max_entries
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        grads = []
        for i, plan in enumerate(ctx.plans):
            sl = slice(None) if len(ctx.plans) == 1 else slice(i, i + 1)
            args = (dout[sl], q[sl], k[sl], v[sl], out[sl], lse[sl], plan)
            grads.append(sparse_backward(*args, scale=ctx.scale, max_entries=ctx.max_entries))
        dq, dk, dv = (_cat(g).to(x.dtype) for g, x in zip(zip(*grads), (q, k, v)))
        return dq, dk, dv, None, None, None


def block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plans: list[BlockPlan],
    *,
    scale: float,
    max_entries: int = DEFAULT_MAX_ENTRIES,
) -> torch.Tensor:
    """Attention of q # [b, n, sq, d] over k, v # [b, n, sk, d] (heads expanded) computing only the
    blocks of ``plans`` (one per sample, or a single plan for every sample). Returns # [b, n, sq, d]
    in q's dtype; a row with no allowed key gets 0."""
    if len(plans) not in (1, q.shape[0]):
        raise ValueError(f"plans must hold 1 or {q.shape[0]} (batch) plans, got {len(plans)}")
    return _BlockSparseAttention.apply(q, k, v, list(plans), scale, max_entries)

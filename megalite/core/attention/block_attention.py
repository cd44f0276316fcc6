"""Attention of one query block against one key/value block, returning the log-sum-exp, and the
merge of such partial results (online softmax).

For scores ``S = scale * Q K^T`` (causal: key j > query i masked) a block returns
``out = softmax(S) V`` and ``lse = log(sum_j exp(S_ij))`` # [b, n, sq] fp32. Two partial results
over disjoint key sets merge exactly::

    lse = logaddexp(lse_1, lse_2);  out = exp(lse_1 - lse) out_1 + exp(lse_2 - lse) out_2

The backward of a block needs only the FINAL ``out`` and ``lse`` of its rows (flash attention's
identity ``dS = P * (dP - rowsum(dO * O))`` with ``P = exp(S - lse)``), so a ring step recomputes
its block's probabilities from the merged numbers and never stores them.

Kernels: on CPU torch's ``_scaled_dot_product_flash_attention_for_cpu`` (and its backward) return
the log-sum-exp (torch 2.13; the package's lowest torch, 2.2, may lack it or take other arguments:
then, and for any input a kernel refuses, the fallback runs); on CUDA the memory-efficient SDPA
kernel does (written, not yet run on a GPU); otherwise (attention dropout, another device) a
plain-matmul block with the same contract runs. Causal masks are top-left aligned and used only on
square diagonal blocks. An optional ``mask`` (bool, True where allowed, broadcast to
``[b, n, sq, sk]``) hides more entries (block-sparse attention); a row it hides entirely returns
``out = 0`` and ``lse = -inf``, which merges as nothing. Dropout (``dropout_p > 0``) draws its
keep-mask from a generator seeded with ``seed`` (one per block), so backward regenerates the
forward's mask.
"""

from __future__ import annotations

import torch

_CPU_FLASH = "_scaled_dot_product_flash_attention_for_cpu"


def _cpu_flash_ok(q: torch.Tensor, dropout_p: float) -> bool:
    return (
        q.device.type == "cpu"
        and dropout_p == 0.0
        and hasattr(torch.ops.aten, _CPU_FLASH)
        and hasattr(torch.ops.aten, _CPU_FLASH + "_backward")
    )


def _cuda_ok(q: torch.Tensor, dropout_p: float) -> bool:
    return q.device.type == "cuda" and dropout_p == 0.0 and q.dtype != torch.float64


def _keep_mask(shape, dropout_p: float, seed: int, device) -> torch.Tensor:
    """The block's dropout multiplier: 0 or 1/(1-p), from a generator seeded with ``seed``."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    keep = torch.rand(shape, generator=gen, device=device) >= dropout_p
    return keep.float() / (1.0 - dropout_p)


def _scores(q, k, *, causal: bool, scale: float, mask=None) -> torch.Tensor:
    s = torch.matmul(q.float(), k.float().transpose(-2, -1)) * scale  # [b, n, sq, sk] fp32
    if causal:
        sq, sk = s.shape[-2:]
        s = s.masked_fill(torch.ones(sq, sk, dtype=torch.bool, device=s.device).triu(1), -torch.inf)
    if mask is not None:
        s = s.masked_fill(~mask, -torch.inf)
    return s


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """The kernels' form of a bool mask: 0 where allowed, -inf where hidden, in q's dtype."""
    if mask is None:
        return None
    if mask.dim() == 3:  # the kernels take 2 or 4 dims
        mask = mask.unsqueeze(0)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, -torch.inf)


def _empty_rows(lse: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``lse`` with -inf on the rows the mask hides entirely (the kernel reports 0 there)."""
    if mask is None:
        return lse
    return lse.masked_fill(~mask.any(-1).expand(lse.shape), -torch.inf)


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """-inf (a row with no allowed key) -> 0, so ``exp(s - lse)`` is 0 there, not nan."""
    return lse.masked_fill(lse == -torch.inf, 0.0)


def block_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    dropout_p: float = 0.0,
    seed: int = 0,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q # [b, n, sq, d]; k, v # [b, n, sk, d] (heads already expanded). Returns
    (out # [b, n, sq, d] in q's dtype, lse # [b, n, sq] fp32)."""
    if _cpu_flash_ok(q, dropout_p):
        try:
            out, lse = getattr(torch.ops.aten, _CPU_FLASH)(
                q, k, v, 0.0, causal, attn_mask=_additive(mask, q.dtype), scale=scale
            )
            return out, _empty_rows(lse.float(), mask)
        except (RuntimeError, TypeError):  # another torch's signature or dtype: the matmul block
            pass
    if _cuda_ok(q, dropout_p) and mask is None:
        try:
            out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
                q, k, v, None, True, 0.0, causal, scale=scale
            )[:2]
            return out, lse[..., : q.shape[2]].float()  # the kernel pads lse's last dim
        except RuntimeError:  # inputs this torch's kernel refuses (dtype, head dim): matmul block
            pass
    s = _scores(q, k, causal=causal, scale=scale, mask=mask)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - _finite(lse).unsqueeze(-1))
    if dropout_p > 0.0:
        p = p * _keep_mask(p.shape, dropout_p, seed, p.device)
    return torch.matmul(p, v.float()).to(q.dtype), lse


def block_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    dropout_p: float = 0.0,
    seed: int = 0,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The block's (dq, dk, dv) given the rows' FINAL ``out`` and ``lse`` and ``dout``
    # [b, n, sq, d] (the merged output's grad)."""
    if mask is not None:
        lse = _finite(lse)
    if _cpu_flash_ok(q, dropout_p):
        try:
            return getattr(torch.ops.aten, _CPU_FLASH + "_backward")(
                dout,
                q,
                k,
                v,
                out,
                lse,
                0.0,
                causal,
                attn_mask=_additive(mask, q.dtype),
                scale=scale,
            )
        except (RuntimeError, TypeError):  # as in block_forward
            pass
    if _cuda_ok(q, dropout_p) and mask is None:
        sq = q.shape[2]
        padded = torch.zeros(*lse.shape[:2], -(-sq // 32) * 32, device=lse.device)
        padded[..., :sq] = lse
        zero = torch.zeros((), dtype=torch.int64, device=q.device)
        try:
            # (grad_out, q, k, v, bias, out, logsumexp, philox seed, offset, dropout_p,
            #  grad_input_mask, causal): no bias, no dropout, grads for q, k and v
            args = (dout, q, k, v, None, out, padded, zero, zero, 0.0, [True] * 3 + [False])
            dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
                *args, causal, scale=scale
            )
            return dq, dk, dv
        except (RuntimeError, TypeError):  # as in block_forward: the matmul block
            pass
    s = _scores(q, k, causal=causal, scale=scale, mask=mask)
    p = torch.exp(s - lse.unsqueeze(-1))  # [b, n, sq, sk] fp32
    do = dout.float()
    dp = torch.matmul(do, v.float().transpose(-2, -1))
    pd = p
    if dropout_p > 0.0:
        keep = _keep_mask(p.shape, dropout_p, seed, p.device)
        pd, dp = p * keep, dp * keep
    dv = torch.matmul(pd.transpose(-2, -1), do)
    delta = (do * out.float()).sum(-1, keepdim=True)  # rowsum(dO * O) # [b, n, sq, 1]
    ds = p * (dp - delta) * scale
    dq = torch.matmul(ds, k.float())
    dk = torch.matmul(ds.transpose(-2, -1), q.float())
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def merge(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge a block's partial (out, lse) into the running one (online softmax); fp32 out. A row
    with ``lse = -inf`` on either side (no key reached yet / in this block) counts as nothing."""
    new_lse = torch.logaddexp(lse, block_lse)
    fin = new_lse.masked_fill(new_lse == -torch.inf, 0.0)  # both -inf: exp(-inf - 0) = 0, no NaN
    out = out * torch.exp(lse - fin).unsqueeze(-1) + block_out.float() * torch.exp(
        block_lse - fin
    ).unsqueeze(-1)
    return out, new_lse


def merge_into(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> None:
    """``merge`` written into ``out`` (fp32) and ``lse`` in place (views allowed): no new tensor
    of out's size but the block's weighted copy, one pass fewer over the rows."""
    new_lse = torch.logaddexp(lse, block_lse)
    fin = new_lse.masked_fill(new_lse == -torch.inf, 0.0)
    out.mul_(torch.exp(lse - fin).unsqueeze(-1))
    out.addcmul_(block_out, torch.exp(block_lse - fin).unsqueeze(-1))
    lse.copy_(new_lse)


def expand_heads(x: torch.Tensor, heads_per_group: int) -> torch.Tensor:
    """# [b, g, s, d] -> [b, g * k, s, d]: query head j*k+i reads group j."""
    return x if heads_per_group == 1 else x.repeat_interleave(heads_per_group, dim=1)


def reduce_heads(dx: torch.Tensor, heads_per_group: int) -> torch.Tensor:
    """The grad of ``expand_heads``: # [b, g * k, s, d] -> [b, g, s, d] (sum over a group)."""
    if heads_per_group == 1:
        return dx
    b, n, s, d = dx.shape
    return dx.view(b, n // heads_per_group, heads_per_group, s, d).sum(2)


def block_flops(b: int, n: int, sq: int, sk: int, d: int, *, causal: bool) -> int:
    """Multiply-add FLOPs of a block's forward (QK^T and PV) over its unmasked score entries."""
    entries = sq * (sq + 1) // 2 if causal else sq * sk
    return 4 * b * n * d * entries

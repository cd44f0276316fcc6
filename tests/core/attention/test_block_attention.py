"""The block attention of ring CP, one process: both kernels (torch's CPU flash op and the
plain-matmul fallback) against autograd through SDPA, the log-sum-exp merge of two key blocks
against one pass (and in place, into a strided view), and dropout's per-block mask replayed in
backward. fp32, rtol 1e-5 / atol 1e-6.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megalite.core.attention import block_attention as ba

TOL = dict(rtol=1e-5, atol=1e-6)


def _inputs(sq=6, sk=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 3, sq, 8, generator=g)
    k, v = torch.randn(2, 3, sk, 8, generator=g), torch.randn(2, 3, sk, 8, generator=g)
    return q, k, v, torch.randn(2, 3, sq, 8, generator=g)


def _reference(q, k, v, dout, causal):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.4)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("fallback", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_block_forward_backward_match_sdpa(monkeypatch, fallback, causal):
    if fallback:
        monkeypatch.setattr(ba, "_cpu_flash_ok", lambda q, p: False)
    q, k, v, dout = _inputs(sk=6 if causal else 9)
    out, lse = ba.block_forward(q, k, v, causal=causal, scale=0.4)
    grads = ba.block_backward(dout, q, k, v, out, lse, causal=causal, scale=0.4)
    expected = _reference(q, k, v, dout, causal)
    for got, want in zip((out, *grads), expected):
        torch.testing.assert_close(got, want, **TOL)


def test_merge_of_two_key_blocks_equals_one_pass():
    q, k, v, dout = _inputs(sq=5, sk=10)
    one, lse_one = ba.block_forward(q, k, v, causal=False, scale=0.4)
    a = ba.block_forward(q, k[:, :, :4], v[:, :, :4], causal=False, scale=0.4)
    b = ba.block_forward(q, k[:, :, 4:], v[:, :, 4:], causal=False, scale=0.4)
    merged, lse = ba.merge(a[0].float(), a[1], *b)
    torch.testing.assert_close(merged, one, **TOL)
    torch.testing.assert_close(lse, lse_one, **TOL)
    # in place, into a strided view (every other head of a wider buffer): the same numbers there,
    # nothing written elsewhere
    out_buf, lse_buf = torch.full((2, 6, 5, 8), 7.0), torch.full((2, 6, 5), 7.0)
    out_buf[:, ::2], lse_buf[:, ::2] = a[0], a[1]
    ba.merge_into(out_buf[:, ::2], lse_buf[:, ::2], *b)
    torch.testing.assert_close(out_buf[:, ::2], one, **TOL)
    torch.testing.assert_close(lse_buf[:, ::2], lse_one, **TOL)
    assert bool((out_buf[:, 1::2] == 7).all()) and bool((lse_buf[:, 1::2] == 7).all())
    # a block that reaches no key of a row (lse -inf) merges as nothing there, without NaN
    hide = torch.ones(5, 6, dtype=torch.bool)
    hide[0] = False
    c = ba.block_forward(q, k[:, :, 4:], v[:, :, 4:], causal=False, scale=0.4, mask=hide)
    into_out, into_lse = a[0].float().clone(), a[1].clone()
    ba.merge_into(into_out, into_lse, *c)
    want_out, want_lse = ba.merge(a[0].float(), a[1], *c)
    torch.testing.assert_close(into_out, want_out, **TOL)
    torch.testing.assert_close(into_lse, want_lse, **TOL)
    torch.testing.assert_close(into_out[:, :, 0], a[0][:, :, 0], **TOL)
    # ... and where neither side has reached a key yet, the row stays empty: 0 and -inf
    both_out, both_lse = c[0].float().clone(), c[1].clone()
    ba.merge_into(both_out, both_lse, *c)
    assert bool((both_out[:, :, 0] == 0).all()) and bool((both_lse[:, :, 0] == -torch.inf).all())
    torch.testing.assert_close(both_out, ba.merge(c[0].float(), c[1], *c)[0], **TOL)
    # backward per block from the merged numbers = the one pass's grads, concatenated over keys
    dq1, dk1, dv1 = ba.block_backward(
        dout, q, k[:, :, :4], v[:, :, :4], merged, lse, causal=False, scale=0.4
    )
    dq2, dk2, dv2 = ba.block_backward(
        dout, q, k[:, :, 4:], v[:, :, 4:], merged, lse, causal=False, scale=0.4
    )
    _, dq, dk, dv = _reference(q, k, v, dout, False)
    torch.testing.assert_close(dq1 + dq2, dq, **TOL)
    torch.testing.assert_close(torch.cat((dk1, dk2), 2), dk, **TOL)
    torch.testing.assert_close(torch.cat((dv1, dv2), 2), dv, **TOL)


def test_dropout_mask_is_replayed_in_backward():
    q, k, v, dout = _inputs()
    out, lse = ba.block_forward(q, k, v, causal=True, scale=0.4, dropout_p=0.3, seed=5)
    dq, dk, dv = ba.block_backward(
        dout, q, k, v, out, lse, causal=True, scale=0.4, dropout_p=0.3, seed=5
    )
    # reference: explicit probabilities times the same keep-mask, through autograd
    keep = ba._keep_mask((2, 3, 6, 6), 0.3, 5, q.device)
    q2, k2, v2 = (t.clone().requires_grad_() for t in (q, k, v))
    scores = (q2 @ k2.transpose(-2, -1) * 0.4).masked_fill(torch.ones(6, 6).triu(1).bool(), -1e30)
    ref = (scores.softmax(-1) * keep) @ v2
    ref.backward(dout)
    assert (keep == 0).any()
    for got, want in zip((out, dq, dk, dv), (ref.detach(), q2.grad, k2.grad, v2.grad)):
        torch.testing.assert_close(got, want, **TOL)

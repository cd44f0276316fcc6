"""The block-sparse ring (``sparse_ring``) on CP 4 against unsplit masked attention, and the ring
messages it skips.

Oracle: SDPA on the whole sequence in one process with the mask as a boolean matrix (causal, an
optional window, optional packed documents), k/v expanded from their query groups; each rank's
inputs, output grad and expected results are the oracle's tensors sliced with ``split_for_cp``.
fp32, rtol 1e-5 / atol 1e-6: only the order of the softmax's sums differs. Attention blocks of 3
tokens against chunks of 4 (not multiples).

Messages are counted by ``CommStats.sends`` (one per ``Ring.exchange``): a deterministic count.
With every step needed a CP 4 ring sends 3 K/V blocks forward, 3 backward and 4 dK/dV
accumulators; a window of 3 tokens leaves step 2 empty on every rank (chunks two apart are at
least 5 tokens away), so K/V jump over it: 2 + 2 + 3.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megalite.core.attention.masks import MaskSpec, build_block_plan
from megalite.core.context_parallel import CommStats, cp_token_indices, split_for_cp
from megalite.core.context_parallel.sparse_ring import needed_steps, sparse_ring_attention
from tests.harness import run_distributed
from tests.mesh import mesh

TOL = dict(rtol=1e-5, atol=1e-6)
B, N, G, D, CHUNK, BLOCK, CP = 2, 4, 2, 8, 4, 3, 4
S = 2 * CP * CHUNK
DOCS = torch.tensor([[0] * 11 + [1] * 13 + [2] * 8, [0] * 20 + [1] * 12])  # [B, S]
CASES = {  # name: (window, documents)
    "causal": (None, False),
    "window": ((3, 0), False),
    "window+docs": ((3, 0), True),
    "docs": (None, True),
}


def _allowed(window, docs: bool) -> torch.Tensor:
    """bool # [B, 1, S, S], True where query i may read key j."""
    q, k = torch.arange(S)[:, None], torch.arange(S)[None, :]
    ok = k <= q
    if window is not None:
        ok = ok & (q - k <= window[0])
    ok = ok.expand(B, S, S)
    if docs:
        ok = ok & (DOCS[:, :, None] == DOCS[:, None, :])
    return ok.unsqueeze(1)


def _oracle(q, k, v, dout, allowed):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    kk, vv = (t.repeat_interleave(N // G, dim=1) for t in (k, v))
    out = F.scaled_dot_product_attention(q, kk, vv, attn_mask=allowed, scale=0.3)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _plans(spec: MaskSpec, rank: int, docs: bool) -> list:
    q_pos = cp_token_indices(S, CP, rank)
    plans = []
    for src in range(CP):
        k_pos = cp_token_indices(S, CP, src)
        if docs:
            plans.append(
                [
                    build_block_plan(
                        spec, q_pos, k_pos, block_size=BLOCK, q_doc=d[q_pos], k_doc=d[k_pos]
                    )
                    for d in DOCS
                ]
            )
        else:
            plans.append([build_block_plan(spec, q_pos, k_pos, block_size=BLOCK)])
    return plans


def _ring_cases() -> dict:
    """Every rank: {case: ring messages it sent}, after checking against the oracle."""
    ps = mesh(1, 1, cp=CP)
    r, sends = ps.cp_rank, {}
    for name, (window, docs) in CASES.items():
        torch.manual_seed(5)
        q, dout = torch.randn(B, N, S, D), torch.randn(B, N, S, D)
        k, v = torch.randn(B, G, S, D), torch.randn(B, G, S, D)
        expected = _oracle(q, k, v, dout, _allowed(window, docs))
        local = [split_for_cp(t, 2, CP, r).requires_grad_() for t in (q, k, v)]
        stats = CommStats()
        out = sparse_ring_attention(
            *local,
            _plans(MaskSpec(window=window), r, docs),
            cp_group=ps.cp_group,
            scale=0.3,
            stats=stats,
        )
        out.backward(split_for_cp(dout, 2, CP, r))
        got = [out.detach(), *(t.grad for t in local)]
        for what, a, e in zip(("out", "dq", "dk", "dv"), got, expected):
            torch.testing.assert_close(a, split_for_cp(e, 2, CP, r), **TOL, msg=f"{name} {what}")
        sends[name] = stats.sends
    ps.destroy()
    return sends


def test_sparse_ring_matches_unsplit_and_skips_empty_steps():
    sends = run_distributed(_ring_cases, CP)
    assert all(s == sends[0] for s in sends), sends  # every rank takes the same steps
    assert sends[0] == {"causal": 10, "window": 7, "window+docs": 7, "docs": 10}


def test_needed_steps_follow_the_band_and_the_chunk_rule():
    assert needed_steps(MaskSpec(), S, CP) == (True,) * CP
    assert needed_steps(MaskSpec(window=(3, 0)), S, CP) == (True, True, False, True)
    # a window reaching 5 tokens back joins chunks two apart (chunk 2's first query, chunk 0's
    # last key), still short of three apart
    assert needed_steps(MaskSpec(window=(5, 0)), S, CP) == (True, True, True, True)
    assert needed_steps(MaskSpec(window=(0, 0)), S, CP) == (True, False, False, False)
    assert needed_steps(MaskSpec(causal=False, window=(0, 0)), S, 1) == (True,)

"""Context-parallel attention alone (ring p2p, all-to-all, all-gather) against unsplit attention.

Oracle: torch's SDPA (causal) on the whole sequence in one process, k/v expanded from their query
groups, RoPE at positions 0..s-1; each rank's inputs, output grad and expected results are the
oracle's tensors sliced with ``split_for_cp`` (the chunk rule; never with a collective). fp32,
rtol 1e-5 / atol 1e-6: only the order of the softmax's sums differs (online merge vs one pass).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megalite.core.context_parallel import (
    CP_COMM_TYPES,
    CommStats,
    check_cp_seq_length,
    context_parallel_attention,
    cp_token_indices,
    rank_major_to_natural,
    split_for_cp,
)
from megalite.models.rotary import apply_rotary, rotary_cos_sin
from tests.harness import run_distributed
from tests.mesh import mesh

TOL = dict(rtol=1e-5, atol=1e-6)
B, D = 2, 8


def _rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x # [b, heads, s, d] at ``positions`` # [s]."""
    cos, sin = rotary_cos_sin(positions.unsqueeze(0), head_dim=D, base=10000.0, dtype=x.dtype)
    return apply_rotary(x.permute(2, 0, 1, 3), cos, sin).permute(1, 2, 0, 3)


def _oracle(q, k, v, dout, heads_per_group):
    """Unsplit causal attention with RoPE: output and grads of the pre-RoPE q, k, v."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    pos = torch.arange(q.shape[2])
    kk, vv = (t.repeat_interleave(heads_per_group, dim=1) for t in (_rope(k, pos), v))
    out = F.scaled_dot_product_attention(_rope(q, pos), kk, vv, is_causal=True, scale=0.3)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _attention_cases(cases) -> dict:
    """Every rank: {(cp, case): the forward attention FLOPs it counted}, after the checks."""
    world, flops = torch.distributed.get_world_size(), {}
    for cp in (2, 4):
        if world % cp:
            continue
        ps = mesh(1, 1, cp=cp)
        r = ps.cp_rank
        for comm_type, n, g, chunk in cases:
            s = 2 * cp * chunk
            torch.manual_seed(11 + s + n + g)
            q, dout = torch.randn(B, n, s, D), torch.randn(B, n, s, D)
            k, v = torch.randn(B, g, s, D), torch.randn(B, g, s, D)
            expected = _oracle(q, k, v, dout, n // g)
            local = [split_for_cp(t, 2, cp, r).requires_grad_() for t in (q, k, v)]
            pos = cp_token_indices(s, cp, r)
            stats = CommStats()
            out = context_parallel_attention(
                _rope(local[0], pos),
                _rope(local[1], pos),
                local[2],
                cp_group=ps.cp_group,
                comm_type=comm_type,
                scale=0.3,
                stats=stats,
            )
            out.backward(split_for_cp(dout, 2, cp, r))
            what = f"{comm_type} cp {cp} n {n} g {g} chunk {chunk}"
            got = [out.detach(), *(t.grad for t in local)]
            for name, a, e in zip(("out", "dq", "dk", "dv"), got, expected):
                torch.testing.assert_close(
                    a, split_for_cp(e, 2, cp, r), **TOL, msg=f"{what} {name}"
                )
            assert stats.bytes_sent > 0, what
            flops[(cp, comm_type, n, g, chunk)] = stats.flops
        ps.destroy()
    return flops


CASES = [
    (comm, n, g, chunk)
    for comm in CP_COMM_TYPES
    for n, g, chunk in ((4, 2, 1), (4, 4, 3), (4, 1, 2))
]


def test_attention_matches_unsplit_cp2_cp4():
    """CP 2 (two replicas) and CP 4 on one 4-rank world, every comm type, GQA/MHA/MQA, chunks of
    1-3 tokens, RoPE at the sliced positions."""
    flops = run_distributed(_attention_cases, 4, CASES)
    # load balance: under the causal mask every rank computes the same unmasked score entries
    # (p2p ring, and all_gather's prefix blocks), and together exactly the unsplit causal
    # attention's s(s+1)/2 per head: no masked block is computed
    for cp in (2, 4):
        for comm, n, g, chunk in CASES:
            if comm == "a2a":  # whole heads over the whole sequence: balanced by construction
                continue
            s, key = 2 * cp * chunk, (cp, comm, n, g, chunk)
            per_rank = [f[key] for f in flops[:cp]]
            assert len(set(per_rank)) == 1, (key, per_rank)
            assert sum(per_rank) == 4 * B * n * D * s * (s + 1) // 2, (key, per_rank)


def test_chunk_rule():
    assert cp_token_indices(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert cp_token_indices(8, 2, 1).tolist() == [2, 3, 4, 5]
    x = torch.arange(12)
    gathered = torch.cat([split_for_cp(x, 0, 3, r) for r in range(3)])
    assert gathered[rank_major_to_natural(12, 3)].tolist() == list(range(12))
    with pytest.raises(ValueError, match="seq_length 12 is not divisible by 2 x context_parallel"):
        check_cp_seq_length(12, 4)

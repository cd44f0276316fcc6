"""Context-parallel attention with attention dropout on (ring p2p and all_gather) against the
unsplit attention, on every rank of CP 2 and CP 4.

Equality with one process under dropout needs the same dropout masks. The oracle draws them from
the masks' contract rather than from the code under test: each rank draws one seed from its
current RNG state (``int(torch.randint(0, 2**40, (1,)))``) and every block it computes takes its
keep-mask ``rand(block shape) >= p`` (scaled by ``1/(1-p)``) from a ``torch.Generator`` seeded

- ring (``ring``'s block plan): rank r against the K/V of rank src, ``seed_r + r * CP + src``; the
  block is r's two query chunks x src's first chunk (src < r), r's second query chunk x src's two
  chunks (src > r), or r's chunks x its own, causal (src = r);
- all_gather: query chunk j against keys ``[0, j c)`` ``seed_r + 2j``, against its own chunk
  (causal) ``seed_r + 2j + 1``.

The test rebuilds each rank's seed from the RNG state it set, places every block's mask at the
block's positions in one ``[s, s]`` mask (checking that the blocks tile the causal triangle exactly
once), and runs plain causal attention ``(softmax(S) * M) V`` with autograd in one process: its
output and its q, k, v grads, sliced with ``split_for_cp``, must equal each rank's. So the forward
applies the masks where the contract says and the merge is right under dropout, and the backward
regenerates every block's forward mask on every rank (a backward that replays another block's
seed, or none, gives other grads). a2a is not here: its dropout is the ordinary core attention's,
on whole heads of the whole sequence (``test_cp_compositions`` covers it in training).
fp32, rtol 1e-5 / atol 1e-6: only the order of the softmax's sums differs.
"""

from __future__ import annotations

import torch

from megalite.core.context_parallel import (
    context_parallel_attention,
    cp_chunk_ids,
    cp_token_indices,
    split_for_cp,
)
from tests.harness import run_distributed
from tests.mesh import mesh

TOL = dict(rtol=1e-5, atol=1e-6)
B, D, P, SCALE = 2, 8, 0.3, 0.3
RNG_SEED = 1234  # rank r of the cp group seeds its generator with RNG_SEED + r


def _drawn_seed(cp_rank: int) -> int:
    """The seed cp rank ``cp_rank`` draws after ``torch.manual_seed(RNG_SEED + cp_rank)``."""
    gen = torch.Generator().manual_seed(RNG_SEED + cp_rank)
    return int(torch.randint(0, 2**40, (1,), generator=gen).item())


def _keep(shape, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(shape, generator=gen) >= P).float() / (1.0 - P)


def _blocks(comm_type: str, cp: int, r: int, c: int):
    """(query positions, key positions, mask seed) of every block cp rank ``r`` computes."""
    seed, mine = _drawn_seed(r), cp_token_indices(2 * cp * c, cp, r)
    if comm_type == "p2p":
        for src in range(cp):
            theirs = cp_token_indices(2 * cp * c, cp, src)
            rows = mine if src <= r else mine[c:]
            cols = theirs[:c] if src < r else theirs
            yield rows, cols, seed + r * cp + src
        return
    for half, j in enumerate(cp_chunk_ids(cp, r)):
        rows = mine[half * c : (half + 1) * c]
        if j:
            yield rows, torch.arange(j * c), seed + 2 * j
        yield rows, torch.arange(j * c, (j + 1) * c), seed + 2 * j + 1


def _mask(comm_type: str, cp: int, n: int, c: int) -> torch.Tensor:
    """Every rank's block masks at their positions # [b, n, s, s]; asserts the blocks tile the
    causal triangle once (entries above the diagonal are never used)."""
    s = 2 * cp * c
    mask, covered = torch.zeros(B, n, s, s), torch.zeros(s, s, dtype=torch.int64)
    for r in range(cp):
        for rows, cols, seed in _blocks(comm_type, cp, r, c):
            mask[:, :, rows[:, None], cols[None, :]] = _keep((B, n, len(rows), len(cols)), seed)
            covered[rows[:, None], cols[None, :]] += 1
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    assert (covered[causal] == 1).all(), covered
    return mask


def _oracle(q, k, v, dout, mask):
    """Causal attention with the dropout multiplier ``mask`` on the probabilities: output and the
    grads of q, k, v (k, v in query groups)."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    hpg, s = q.shape[1] // k.shape[1], q.shape[2]
    kk, vv = (t.repeat_interleave(hpg, dim=1) for t in (k, v))
    scores = (q @ kk.transpose(-2, -1)) * SCALE
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), -torch.inf)
    out = (torch.softmax(scores, dim=-1) * mask) @ vv
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _dropout_cases(cases) -> dict:
    """Every rank, after its checks: {case: how far its output is from dropout-free attention}."""
    moved = {}
    for cp in (2, 4):
        ps = mesh(1, 1, cp=cp)
        r = ps.cp_rank
        for comm_type, n, g, c in cases:
            s = 2 * cp * c
            torch.manual_seed(11 + s + n + g)
            q, dout = torch.randn(B, n, s, D), torch.randn(B, n, s, D)
            k, v = torch.randn(B, g, s, D), torch.randn(B, g, s, D)
            expected = _oracle(q, k, v, dout, _mask(comm_type, cp, n, c))
            plain = _oracle(q, k, v, dout, torch.ones(B, n, s, s))[0]
            local = [split_for_cp(t, 2, cp, r).requires_grad_() for t in (q, k, v)]
            torch.manual_seed(RNG_SEED + r)
            out = context_parallel_attention(
                *local, cp_group=ps.cp_group, comm_type=comm_type, scale=SCALE, dropout_p=P
            )
            out.backward(split_for_cp(dout, 2, cp, r))
            what = f"{comm_type} cp {cp} rank {r} n {n} g {g} chunk {c}"
            got = [out.detach(), *(t.grad for t in local)]
            for name, a, e in zip(("out", "dq", "dk", "dv"), got, expected):
                torch.testing.assert_close(
                    a, split_for_cp(e, 2, cp, r), **TOL, msg=f"{what} {name}"
                )
            change = (out.detach() - split_for_cp(plain, 2, cp, r)).abs().max()
            moved[(cp, comm_type, n, g, c)] = change.item()
        ps.destroy()
    return moved


CASES = [(comm, n, g, c) for comm in ("p2p", "all_gather") for n, g, c in ((4, 2, 2), (2, 2, 3))]


def test_dropout_masks_replayed_on_every_rank_equal_unsplit_attention():
    """CP 2 (two replicas) and CP 4 on one 4-rank world: every rank's blocks (CP 4: four ring
    steps per rank) replay their forward masks in backward; GQA and MHA, chunks of 2-3 tokens."""
    moved = run_distributed(_dropout_cases, 4, CASES)
    for per_rank in moved:  # dropout is really on: every rank's output moved
        assert min(per_rank.values()) > 1e-2, per_rank

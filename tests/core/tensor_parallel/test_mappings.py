"""Each autograd mapping does what its name says forward and its adjoint backward.

Checked against tensors built by hand from the rank number and sliced with ``chunk`` -- never with
the collective under test. Also keeps the gloo ``reduce_scatter`` / ``all_gather_into_tensor`` paths
the
package depends on exercised on the installed torch (pyproject's lower bound).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megalite.core.tensor_parallel import mappings as m
from tests.harness import run_distributed


def _mappings_case():
    group = dist.group.WORLD
    n, r = dist.get_world_size(), dist.get_rank()
    S, B, H = 4 * n, 2, 3 * n
    # every rank can build every rank's tensor: value = f(rank, position)
    base = torch.arange(S * B * H, dtype=torch.float32).view(S, B, H)
    per_rank = [base * (k + 1) for k in range(n)]
    total = sum(per_rank)
    mine = per_rank[r]

    def fwd_bwd(fn, x, dy):
        x = x.detach().clone().requires_grad_()
        y = fn(x)
        y.backward(dy)
        return y.detach(), x.grad

    out = {}
    dy_full = [base + 100 * k for k in range(n)]  # a distinct upstream grad per rank
    # copy_to: identity forward, all-reduce backward
    y, dx = fwd_bwd(lambda x: m.copy_to_tp_region(x, group), mine, dy_full[r])
    out["copy"] = torch.equal(y, per_rank[r]) and torch.equal(dx, sum(dy_full))
    # reduce_from: all-reduce forward, identity backward
    y, dx = fwd_bwd(lambda x: m.reduce_from_tp_region(x, group), mine, dy_full[r])
    out["reduce"] = torch.equal(y, total) and torch.equal(dx, dy_full[r])
    # scatter_to_tp: split last dim forward, all-gather backward (each rank's dy is its chunk)
    dy_chunks = [d.chunk(n, -1)[k] for k, d in enumerate(dy_full)]
    y, dx = fwd_bwd(lambda x: m.scatter_to_tp_region(x, group), base, dy_chunks[r])
    out["scatter_tp"] = torch.equal(y, base.chunk(n, -1)[r]) and torch.equal(
        dx, torch.cat(dy_chunks, -1)
    )
    # gather_from_tp: all-gather last dim forward, split backward
    y, dx = fwd_bwd(lambda x: m.gather_from_tp_region(x, group), base.chunk(n, -1)[r], base)
    out["gather_tp"] = torch.equal(y, base) and torch.equal(dx, base.chunk(n, -1)[r])
    # scatter_to_sp: split first dim forward, all-gather backward
    sp_chunks = [d.chunk(n, 0)[k] for k, d in enumerate(dy_full)]
    y, dx = fwd_bwd(lambda x: m.scatter_to_sp_region(x, group), base, sp_chunks[r])
    out["scatter_sp"] = torch.equal(y, base.chunk(n, 0)[r]) and torch.equal(
        dx, torch.cat(sp_chunks, 0)
    )
    # gather_from_sp: all-gather forward, reduce-scatter backward (partial grads) or split
    y, dx = fwd_bwd(lambda x: m.gather_from_sp_region(x, group), base.chunk(n, 0)[r], dy_full[r])
    out["gather_sp"] = torch.equal(y, base) and torch.equal(dx, sum(dy_full).chunk(n, 0)[r])
    y, dx = fwd_bwd(
        lambda x: m.gather_from_sp_region(x, group, grad_is_partial=False),
        base.chunk(n, 0)[r],
        base,
    )
    out["gather_sp_whole"] = torch.equal(dx, base.chunk(n, 0)[r])
    # reduce_scatter_to_sp: reduce-scatter forward, all-gather backward
    y, dx = fwd_bwd(lambda x: m.reduce_scatter_to_sp_region(x, group), mine, sp_chunks[r])
    out["reduce_scatter_sp"] = torch.equal(y, total.chunk(n, 0)[r]) and torch.equal(
        dx, torch.cat(sp_chunks, 0)
    )
    return out


def test_every_mapping_and_its_adjoint_on_2_and_4_ranks():
    for world in (2, 4):
        for rank, out in enumerate(run_distributed(_mappings_case, world)):
            failed = [k for k, ok in out.items() if not ok]
            assert not failed, f"world {world} rank {rank}: {failed}"


def test_group_of_one_is_identity_without_communication():
    x = torch.randn(4, 2, 3, requires_grad=True)
    for fn in (
        m.copy_to_tp_region,
        m.reduce_from_tp_region,
        m.scatter_to_tp_region,
        m.gather_from_tp_region,
        m.scatter_to_sp_region,
        m.gather_from_sp_region,
        m.reduce_scatter_to_sp_region,
    ):
        assert fn(x, None) is x

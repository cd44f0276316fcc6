"""The harness itself: results in rank order, a failing rank named, a blocked rank bounded."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from tests import harness
from tests.harness import DistributedCaseError, run_distributed


def _sum_of_ranks(offset):
    t = torch.tensor([float(dist.get_rank() + offset)])
    dist.all_reduce(t)
    return dist.get_rank(), t.item()


def _fail_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("boom on purpose")
    dist.barrier()


BLOCK_S = 900  # far past the harness's 3 s and any pool start on a loaded machine


def _block_on_rank_zero():
    if dist.get_rank() == 0:  # without the harness's timeout the case returns, with no error
        time.sleep(BLOCK_S)


def _die_on_rank_one_after_rank_zero_fails():
    if dist.get_rank() == 1:  # a rank killed (out of memory, SIGKILL) sends no traceback
        time.sleep(0.5)
        os._exit(9)
    raise ConnectionError("closed by peer, as a peer of a dead rank sees it")


def test_pools_still_fork_after_this_process_runs_an_optimizer_step():
    # an oracle's optimizer step in the test process imports torch._dynamo, which sets an
    # environment variable: were the pools compared against the fork server's environment after
    # that, every later pool would be spawned and re-import torch and megalite in each worker
    run_distributed(_sum_of_ranks, 2, 0)  # the fork server runs
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    torch.optim.AdamW([p]).step()
    assert harness._context().get_start_method() == "forkserver"


def test_results_come_back_in_rank_order():
    out = run_distributed(_sum_of_ranks, 4, 10)
    assert out == [(r, 4 * 10 + 0 + 1 + 2 + 3) for r in range(4)]


def test_exception_names_rank_and_traceback():
    with pytest.raises(DistributedCaseError, match=r"rank 1 of 2(.|\n)*boom on purpose"):
        run_distributed(_fail_on_rank_one, 2)
    # the pool was replaced: the next case runs
    assert run_distributed(_sum_of_ranks, 2, 0) == [(0, 1.0), (1, 1.0)]


def test_blocked_rank_fails_within_timeout():
    # no clock read here: a harness that did not stop the blocked rank would get its result
    # after BLOCK_S and raise nothing
    with pytest.raises(DistributedCaseError, match=r"rank\(s\) \[0\] of 2 did not finish"):
        run_distributed(_block_on_rank_zero, 2, timeout=3)


def test_a_dead_rank_is_named_beside_its_peers_errors():
    with pytest.raises(
        DistributedCaseError, match=r"rank\(s\) \[1\] had died \(exit codes \[9\]\)"
    ):
        run_distributed(_die_on_rank_one_after_rank_zero_fails, 2)

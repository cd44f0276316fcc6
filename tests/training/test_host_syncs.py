"""A training iteration reads nothing back from the device outside the log interval.

The whole loop (``Trainer.train``: the step, the loss/NaN bookkeeping, the LR schedule) is run
under ``SyncCounter`` with ``--log-interval 4``; reads are attributed to the iteration whose step
ran last. Iterations 1-3 and 5-7 must read nothing; 4 and 8 read the interval (one packed copy,
the grad-norm/loss-scale log values, the peak-memory max) and 8 also the end of the run. fp16
reads ``found_inf`` once per step (the skip decision), so it is checked with that allowance.
"""

from __future__ import annotations

import pytest
import torch

from megalite.core.parallel_state import ParallelState
from megalite.training.forward_step import make_forward_step
from tests.harness import run_distributed
from tests.training.common import config, trainer_and_data
from tests.training.sync_counter import SyncCounter

LOGGED = {4, 8}


def _reads_per_iteration(flags: list[str], ps: ParallelState) -> dict[int, int]:
    run = "--train-iters 8 --log-interval 4".split()
    cfg = config(*run, *flags, world_size=ps.world_size, rank=ps.rank())
    trainer, data = trainer_and_data(cfg, ps)
    step = trainer.step
    with SyncCounter() as counter:

        def counted_step(*args, **kwargs):
            counter.mark(str(trainer.result.iteration + 1))
            return step(*args, **kwargs)

        trainer.step = counted_step
        trainer.train(make_forward_step(torch.device("cpu")), data)
    return {int(k): v for k, v in counter.counts.items() if k != "start"}, counter.where


@pytest.mark.parametrize(
    "flags, per_step",
    [
        ([], 0),
        (["--bf16"], 0),
        (["--use-distributed-optimizer", "--overlap-grad-reduce"], 0),
        (["--fp16", "--initial-loss-scale", "1024"], 1),
    ],
    ids=["fp32", "bf16", "zero1-overlap", "fp16"],
)
def test_no_host_read_outside_the_log_interval(flags, per_step):
    counts, where = _reads_per_iteration(flags, ParallelState.single())
    for it in range(1, 9):
        if it not in LOGGED:
            assert counts.get(it, 0) == per_step, (it, where.get(str(it)))
    assert counts.get(4, 0) > 0  # the log line does read (the counter sees reads)


def test_windowed_attention_reads_nothing_after_its_plans_are_built():
    """The block plans are a host structure, built in the first iteration; later iterations
    look them up by Python ints, reading nothing from the device (the lookup was two reads a
    layer per forward)."""
    flags = ["--window-size", "5,0", "--attention-block-size", "4", "--attention-dropout", "0"]
    counts, where = _reads_per_iteration(flags, ParallelState.single())
    assert counts.get(1, 0) > 0  # the plans' build (the counter sees reads)
    for it in (2, 3, 5, 6, 7):
        assert counts.get(it, 0) == 0, (it, where.get(str(it)))


def _pipeline_case():
    from tests.mesh import mesh

    ps = mesh(1, 2)
    try:
        counts, where = _reads_per_iteration(
            ["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer"], ps
        )
    finally:
        ps.destroy()
    # iteration 1 also checks the neighbours' activation shapes, once (p2p.check_neighbours)
    return {it: n for it, n in counts.items() if it not in LOGGED | {1}}, where


def test_no_host_read_outside_the_log_interval_pp2_dp2_zero1():
    for counts, where in run_distributed(_pipeline_case, 4):
        assert not any(counts.values()), (counts, where)

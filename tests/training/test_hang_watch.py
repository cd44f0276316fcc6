"""``--distributed-timeout-minutes`` given turns the op recorder and hang watchdog on with that
timeout (``--hang-watchdog`` with the default timeout); neither given leaves them off. A run with
them on (PP 2) trains to the same losses as without, records its pipeline messages and actions
with their micro-batch, and turns the recorder off at the end."""

from __future__ import annotations

import torch.distributed as dist

from megalite.core.op_record import RECORDER
from megalite.training.arguments import parse_args
from megalite.training.hang_watch import start_hang_watch, stop_hang_watch
from tests.harness import run_distributed
from tests.mesh import mesh
from tests.training.common import BASE, config, train_losses

ENV = {"WORLD_SIZE": "1"}


def test_the_timeout_flag_turns_the_watchdog_on():
    cases = {
        (): (False, 10.0),
        ("--distributed-timeout-minutes", "0.5"): (True, 0.5),
        ("--hang-watchdog",): (True, 10.0),
    }
    for flags, want in cases.items():
        p = parse_args([*BASE, *flags], ENV).parallel
        assert (p.hang_watchdog, p.distributed_timeout_minutes) == want, flags


def _case():
    from_flags = ["--pipeline-model-parallel-size", "2", "--train-iters", "2"]
    rank = dist.get_rank()
    ps = mesh(1, 2)
    plain = train_losses(config(*from_flags, world_size=2, rank=rank), ps).losses
    cfg = config(*from_flags, "--distributed-timeout-minutes", "5", world_size=2, rank=rank)
    watch = start_hang_watch(cfg.parallel, ps)
    watched = train_losses(cfg, ps).losses
    recorded = {(r.op, r.what) for r in RECORDER.records()}
    with_microbatch = {r.op for r in RECORDER.records() if r.microbatch is not None}
    stop_hang_watch(watch)
    return plain, watched, recorded, with_microbatch, RECORDER.enabled


def test_a_watched_run_trains_the_same_and_records_its_messages():
    for rank, (plain, watched, recorded, with_microbatch, on) in enumerate(
        run_distributed(_case, 2)
    ):
        assert watched == plain and not on
        assert {("compute", None), ("shape exchange", "activation shape and dtype")} <= recorded
        want = {"send", "recv", "compute"}
        assert want <= with_microbatch, (rank, with_microbatch)
        assert ("broadcast", "token count") in recorded or ("all_reduce", None) in recorded

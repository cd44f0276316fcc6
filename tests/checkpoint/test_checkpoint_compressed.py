"""The compressed optimizers resume exactly: 2N iterations straight equal N, a checkpoint, and N
more after --load (DP 2, the real ``pretrain`` loop on mock data). N = 3 with the freeze at 1: the
checkpoint falls in the compressed phase, so the worker and server error buffers (and 0/1 Adam's
local update, anchor and schedule: its step 3 is a local step) must come back from each DP rank's
``dp_rank_optim_NNN.pt`` for the losses after it to be bitwise equal. Loading at another DP size
restarts them from zero with one warning line (a unit case below)."""

from __future__ import annotations

import logging
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch import nn

from megalite.core.optimizer import build_optimizer
from megalite.training.pretrain import pretrain
from tests.harness import run_distributed
from tests.training.common import config

N = 3
OPTIMIZERS = {
    "onebit-adam": ["--onebit-freeze-step", "1"],
    "onebit-lamb": ["--onebit-freeze-step", "1"],
    "zero-one-adam": [
        *("--zero-one-var-freeze-step", "2", "--zero-one-var-update-scaler", "1"),
        *("--zero-one-local-step-scaler", "1", "--zero-one-local-step-clipper", "2"),
    ],
}


def _resume(name: str, save: str) -> tuple[list[float], list[float]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    env = {"RANK": str(rank), "WORLD_SIZE": str(world)}
    flags = ["--optimizer", name, *OPTIMIZERS[name], "--train-iters", str(2 * N)]
    flags += ["--save", save, "--save-interval", str(N)]
    straight = pretrain(config(*flags, world_size=world, rank=rank), env=env)
    resumed_cfg = config(*flags, "--load", save, "--ckpt-step", str(N), world_size=world, rank=rank)
    return straight.losses, pretrain(resumed_cfg, env=env).losses


def _case(name: str, save: str) -> None:
    straight, resumed = _resume(name, save)
    assert len(straight) == 2 * N and resumed == straight[N:], (name, straight, resumed)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_resume_is_exact(name: str) -> None:
    with tempfile.TemporaryDirectory() as save:
        run_distributed(_case, 2, name, save, timeout=600)


def test_other_dp_size_restarts_the_errors_with_one_warning(caplog) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = build_optimizer(model, optimizer="onebit-adam", lr=0.1, weight_decay=0.0, clip_grad=0.0)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    saved = {**opt.dp_rank_state(), "dp_size": 2}  # as a DP-2 rank wrote it
    opt.optimizer.compressor.parts[0][0].worker_error.fill_(1.0)
    with caplog.at_level(logging.WARNING):
        opt.load_dp_rank_state(saved)
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1 and "error-feedback" in lines[0] and "data-parallel size" in lines[0]

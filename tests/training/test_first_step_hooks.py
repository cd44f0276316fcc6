"""The trainer's first-step hooks: ``around_first_step`` wraps the first step only,
``after_first_update`` runs once, after the first step whose update was applied (an fp16 step the
loss scaler skips is not one), and the memory report measured after the first step rides on it."""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch

from megalite.core.parallel_state import ParallelState
from megalite.training.forward_step import make_forward_step
from megalite.training.pretrain import FirstStepHook, build_run
from tests.training.common import LogCapture, config

CPU = torch.device("cpu")
FP16 = ["--fp16", "--initial-loss-scale", "1024", "--hysteresis", "1"]  # one inf: one skip


class Recorder(FirstStepHook):
    """Records (event, the trainer's iteration count, whether the last step updated)."""

    def __init__(self, name: str, events: list):
        self.name, self.events = name, events

    def around_first_step(self, trainer):
        return self._around(trainer)

    @contextmanager
    def _around(self, trainer):
        self.events.append((self.name, "enter", trainer.result.iteration))
        yield
        self.events.append((self.name, "exit", trainer.result.iteration))

    def after_first_update(self, trainer):
        self.events.append((self.name, "update", trainer.result.iteration))


def _inf_grad_at(trainer, iteration: int) -> None:
    """Put inf into one weight's grad during ``iteration`` (1-based): fp16 skips that step."""
    param = trainer.model[0].module.decoder.layers[0].mlp.linear_fc1.weight

    def hook(grad: torch.Tensor) -> torch.Tensor:
        if trainer.result.iteration + 1 == iteration:
            return torch.full_like(grad, math.inf)
        return grad

    param.register_hook(hook)


def test_hooks_wrap_the_first_step_and_see_the_first_update_after_a_skipped_step():
    events: list = []
    cfg = config(
        "--fp16", "--initial-loss-scale", "1024", "--hysteresis", "1", "--train-iters", "3"
    )
    hooks = [Recorder("a", events), Recorder("b", events)]
    run = build_run(cfg, ParallelState.single(), CPU, resume=False, first_step_hooks=hooks)
    _inf_grad_at(run.trainer, 1)
    result = run.trainer.train(make_forward_step(CPU), run.train_iter)
    assert result.skipped_iterations == 1
    assert events == [
        ("a", "enter", 0),  # the first step, in the order given ...
        ("b", "enter", 0),
        ("b", "exit", 0),  # ... left in reverse; it was skipped: no update yet
        ("a", "exit", 0),
        ("a", "update", 1),  # the second step applied the first update: once, in order
        ("b", "update", 1),
    ]


def test_the_memory_report_is_measured_after_the_first_applied_update():
    cfg = config(
        "--fp16", "--initial-loss-scale", "1024", "--hysteresis", "1", "--train-iters", "3"
    )
    cfg.logging.log_interval = 1
    run = build_run(cfg, ParallelState.single(), CPU, resume=False, log=True)
    _inf_grad_at(run.trainer, 1)
    with LogCapture() as logs:
        run.trainer.train(make_forward_step(CPU), run.train_iter)
    measured = [i for i, x in enumerate(logs.lines) if "measured after the first step" in x]
    iterations = [i for i, x in enumerate(logs.lines) if x.startswith(" iteration ")]
    assert len(measured) == 1 and len(iterations) == 3
    assert iterations[0] < measured[0] < iterations[1]  # during the second step, not the first

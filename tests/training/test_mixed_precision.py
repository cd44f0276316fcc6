"""Mixed precision in the real training loop (one process, tiny GPT on mock data).

- fp16: an inf injected into one parameter's gradient at iteration 3 skips exactly that step (the
  parameters do not move, the LR schedule does not advance, the skip is counted and logged) and the
  dynamic scale halves (hysteresis 1); the other steps update.
- fp16: a NaN loss on a step the scaler skips is counted as a nan iteration, not a fatal error.
- bf16 / fp32: a NaN loss stops the run with an error naming the iteration (on by default), and is
  only counted with --no-check-for-nan-in-loss-and-grad.
- bf16 (fp32 master weights, fp32 grad accumulation) learns the mock task: the loss falls by more
  than 1.5 nats in 40 steps and stays within 5% of the fp32 run's.
- host syncs: one ``train_step`` (schedule, grad sync, optimizer step, loss average) reads no
  tensor on the host in fp32 and bf16, plain or ZeRO-1 (counted by wrapping ``Tensor.item``,
  ``tolist``, ``__bool__``, ``__float__``, ``__int__``, ``__index__``; torch.optim's own CPU step
  counter excepted, which never lives on the device); fp16 reads ``found_inf`` exactly once.
"""

from __future__ import annotations

import math

import pytest
import torch

from megalite.core.parallel_state import ParallelState
from megalite.training.forward_step import make_forward_step
from megalite.training.pretrain import TrainingError
from tests.training.common import LogCapture, config, train_losses, trainer_and_data
from tests.training.sync_counter import SyncCounter

CPU = torch.device("cpu")


class Injector:
    """A forward step that knows the iteration (1-based) and can spoil it: ``grad`` puts inf into
    the grad of ``param`` (a hook), ``loss`` multiplies the per-token loss by NaN. Also records
    what the test needs at the start of every iteration."""

    def __init__(self, trainer, *, iteration: int, kind: str, param: torch.nn.Parameter):
        self.trainer, self.target, self.kind, self.param = trainer, iteration, kind, param
        self.calls = 0
        self.inner = make_forward_step(CPU)
        self.scales: list[float] = []
        self.snapshots: list[torch.Tensor] = []
        param.register_hook(self._grad_hook)

    @property
    def iteration(self) -> int:
        return (self.calls - 1) // self.trainer.num_microbatches + 1

    def _grad_hook(self, grad: torch.Tensor) -> torch.Tensor:
        if self.kind == "grad" and self.iteration == self.target:
            return torch.full_like(grad, math.inf)
        return grad

    def __call__(self, data_iterator, model):
        self.calls += 1
        if (self.calls - 1) % self.trainer.num_microbatches == 0:  # first micro-batch
            self.scales.append(float(self.trainer.optimizer.get_loss_scale().item()))
            self.snapshots.append(self.param.detach().float().clone())
        output, loss_func = self.inner(data_iterator, model)
        if self.kind == "loss" and self.iteration == self.target:
            output = output * math.nan
        return output, loss_func


def _run(cfg, *, iteration: int, kind: str):
    trainer, data = trainer_and_data(cfg, ParallelState.single())
    param = trainer.model[0].module.decoder.layers[0].mlp.linear_fc1.weight
    injector = Injector(trainer, iteration=iteration, kind=kind, param=param)
    with LogCapture() as logs:
        result = trainer.train(injector, data)
    return trainer, injector, result, logs.lines


def test_fp16_inf_grad_skips_exactly_that_step_and_halves_the_scale():
    cfg = config(
        "--fp16", "--initial-loss-scale", "1024", "--hysteresis", "1", "--log-interval", "5"
    )
    trainer, inj, result, lines = _run(cfg, iteration=3, kind="grad")
    assert trainer.model[0].module.embedding.word_embeddings.weight.dtype == torch.float16
    # the scale each iteration started with: halved by the overflow of iteration 3, not before
    assert inj.scales == [1024.0, 1024.0, 1024.0, 512.0, 512.0]
    assert float(trainer.optimizer.get_loss_scale().item()) == 512.0
    # iteration 3 left the weights untouched; every other iteration moved them
    moved = [not torch.equal(a, b) for a, b in zip(inj.snapshots, inj.snapshots[1:])]
    assert moved == [True, True, False, True]
    assert result.skipped_iterations == 1 and result.nan_iterations == 0
    assert [math.isnan(g) for g in result.grad_norms] == [False, False, True, False, False]
    assert trainer.scheduler.num_steps == 4  # the skipped step did not advance the schedule
    line = next(x for x in lines if "iteration        5/" in x)
    assert "number of skipped iterations:   1" in line and "loss scale: 512.0" in line
    # same first three losses as a clean run (the skip happens after the forward)
    clean = train_losses(config("--fp16", "--initial-loss-scale", "1024"), ParallelState.single())
    assert result.losses[:3] == clean.losses[:3]
    assert result.losses[3] != clean.losses[3]


def test_fp16_nan_loss_on_a_skipped_step_is_counted_not_fatal():
    cfg = config("--fp16", "--initial-loss-scale", "1024", "--hysteresis", "1")
    _, inj, result, _ = _run(cfg, iteration=2, kind="loss")
    assert result.skipped_iterations == 1 and result.nan_iterations == 1
    assert inj.scales[2] == 512.0


@pytest.mark.parametrize("precision", [[], ["--bf16"]])
def test_nan_loss_stops_the_run_naming_the_iteration(precision):
    cfg = config(*precision)
    with pytest.raises(TrainingError, match=r"^iteration 2: the loss is not finite"):
        _run(cfg, iteration=2, kind="loss")


def test_nan_loss_is_counted_when_the_check_is_off():
    cfg = config("--no-check-for-nan-in-loss-and-grad", "--train-iters", "3")
    _, _, result, _ = _run(cfg, iteration=3, kind="loss")
    assert result.nan_iterations == 1 and result.skipped_iterations == 0


def test_bf16_learns_the_mock_task_with_fp32_master_weights():
    flags = ["--train-iters", "40", "--lr", "1e-2", "--lr-decay-style", "constant"]
    cfg = config("--bf16", "--accumulate-allreduce-grads-in-fp32", *flags)
    trainer, data = trainer_and_data(cfg, ParallelState.single())
    model, opt = trainer.model[0].grad_wrapper, trainer.optimizer
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in opt.master_params} == {torch.float32}
    assert {b.grad_dtype for b in model.grad_buffers} == {torch.float32}
    bf16 = trainer.train(make_forward_step(CPU), data).losses
    fp32 = train_losses(config(*flags), ParallelState.single()).losses
    assert bf16[0] - bf16[-1] > 1.5, bf16
    for i in (9, 19, 39):  # tracks fp32 (bf16 rounding only)
        assert abs(bf16[i] - fp32[i]) < 0.05 * fp32[i], (i, bf16[i], fp32[i])
    # the masters hold what bf16 cannot: they are not all exactly bf16-representable
    assert any(not torch.equal(m, m.bfloat16().float()) for m in opt.master_params)


@pytest.mark.parametrize(
    "flags, reads",
    [
        ([], 0),
        (["--bf16", "--accumulate-allreduce-grads-in-fp32"], 0),
        (["--use-distributed-optimizer"], 0),
        (["--bf16", "--use-distributed-optimizer"], 0),
        (["--fp16", "--initial-loss-scale", "1024"], 1),
        (["--fp16", "--initial-loss-scale", "1024", "--use-distributed-optimizer"], 1),
    ],
    ids=["fp32", "bf16", "fp32-zero1", "bf16-zero1", "fp16", "fp16-zero1"],
)
def test_a_training_step_reads_nothing_on_the_host_but_fp16_found_inf(flags, reads):
    trainer, data = trainer_and_data(config(*flags), ParallelState.single())
    forward = make_forward_step(CPU)
    n = trainer.num_microbatches
    batches = [next(data[0]) for _ in range(2 * n)]  # the data loader is host work: not counted
    trainer.step(forward, iter(batches[:n]))  # first step: lazy state created
    with SyncCounter() as host:
        step = trainer.step(forward, iter(batches[n:]))
    assert host.counts["start"] == reads, host.where
    assert step.update_successful and torch.is_tensor(step.grad_norm)
    assert all(torch.is_tensor(v) for v in step.losses.values())

"""The training loop over a built run: steps, progress lines, evaluation, checkpoints, exits.

    trainer = Trainer(cfg, ps, device=device, tracker=tracker)   # model chunks, optimizer, ...
    result = trainer.train(forward_step_func, [train_iter], [valid_iter])

A step reads nothing back from the device: losses, counters and the NaN/inf watch accumulate in
``step_stats.DeviceStats`` and are read every ``--log-interval`` iterations, before every
checkpoint and at the end (one device -> host copy each time). So a non-finite loss or grad norm
stops the run (``TrainingError`` naming the first such iteration,
``--check-for-nan-in-loss-and-grad``, on by default) at the next read, and never reaches a saved
checkpoint. fp16 steps the loss scaler skips are counted, not fatal. Logging happens on the last
rank (the last pipeline stage, ``progress.Progress``); nothing else here depends on the layout.

Whatever watches the first step (the memory report, the planner's comparison in
``pretrain_gpt.py``) is a ``FirstStepHook`` the loop calls; nothing wraps ``Trainer.step``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megalite.core.moe import routers_of, set_aux_loss_scale, update_expert_bias
from megalite.core.parallel_state import ParallelState
from megalite.core.pipeline_parallel.forward_backward import get_forward_backward_func
from megalite.core.pipeline_parallel.model_chunk import ModelChunk
from megalite.core.tensor_parallel.modes import tensor_parallel_mode
from megalite.models.moe_layer import read_moe_stats
from megalite.training import checkpoint_io
from megalite.training.checkpoint_io import exit_duration_reached
from megalite.training.components import setup_model_and_optimizer
from megalite.training.config import PretrainConfig
from megalite.training.evaluate import evaluate_and_log
from megalite.training.microbatches import batch_size_calculator
from megalite.training.model_chunks import schedule_chunks
from megalite.training.pipeline_config import effective_schedule
from megalite.training.progress import Progress
from megalite.training.signals import ExitSignalHandler, any_rank_signalled
from megalite.training.step_stats import DeviceStats, IntervalSnapshot
from megalite.training.stragglers import StragglerMeter, StragglerReport
from megalite.training.tensorboard import TensorBoardLogger
from megalite.training.train_step import StepResult, train_step

logger = logging.getLogger(__name__)


class TrainingError(RuntimeError):
    """The run cannot continue (a NaN/inf loss or grad norm); the message names the iteration."""


@dataclass
class TrainResult:
    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    losses: list[float] = field(default_factory=list)  # lm loss per iteration (last stage)
    grad_norms: list[float] = field(default_factory=list)  # per iteration; NaN when skipped
    skipped_iterations: int = 0
    nan_iterations: int = 0
    validation: dict[str, float] = field(default_factory=dict)  # the last evaluation
    test: dict[str, float] = field(default_factory=dict)
    exited_on_signal: bool = False  # --exit-signal-handler: stopped early, checkpoint saved
    # per read of the numbers (each --log-interval), MoE models only: the mean over MoE layers of
    # each layer's load-balancing and z loss (per micro-batch, coefficient included)
    moe_losses: list[dict[str, float]] = field(default_factory=list)


def as_list(x) -> list:
    """A model chunk / data iterator, or a list of them (one per virtual stage), as a list."""
    return list(x) if isinstance(x, (list, tuple)) else [x]


class FirstStepHook:
    """What watches the first training step of a ``Trainer``; subclass and override either method.
    Both run on every rank (each may be a collective) and get the trainer itself.

    ``around_first_step`` returns a context manager the trainer enters just before its first
    ``step`` (forward, backward, optimizer step) and leaves right after it, whether or not that
    step updated the weights. ``after_first_update`` runs once, right after the first step whose
    optimizer update was applied (an fp16 step the loss scaler skips is not one): inside the
    contexts when that is the first step. Hooks run in the order given; contexts are left in
    reverse."""

    def around_first_step(self, trainer: Trainer) -> AbstractContextManager:
        return nullcontext()

    def after_first_update(self, trainer: Trainer) -> None:
        return None


class Trainer:
    """The loop's state and its pieces; ``pretrain.build_run`` builds one, tests may too.

    ``model`` is the list of this rank's model chunks (``ModelChunk``: the GPT stage and the
    data-parallel wrapper they share; one without virtual pipeline stages), ``optimizer`` covers
    all of them. ``first_step_hooks``: see ``FirstStepHook``; more may be appended to the list
    before the first step."""

    def __init__(
        self,
        cfg: PretrainConfig,
        ps: ParallelState,
        *,
        device: torch.device,
        tracker,
        first_step_hooks: Sequence[FirstStepHook] = (),
    ):
        self.cfg, self.ps, self.device = cfg, ps, device
        self.rng_tracker = tracker  # saved and restored by checkpoints
        self.start_time = time.time()  # for --exit-duration-in-mins
        self.last_saved_iteration: int | None = None  # set by save/load_checkpoint
        self.async_writer = checkpoint_io.async_writer(cfg)  # --async-save, else None
        self.first_step_hooks: list[FirstStepHook] = list(first_step_hooks)
        self._stepped = False  # a step ran: the hooks' first-step contexts are spent
        self._updated = False  # an update was applied: ``after_first_update`` has run
        model, self.optimizer, self.scheduler = setup_model_and_optimizer(
            cfg, ps, device=device, rng_tracker=tracker
        )
        # one per model chunk: the chunks of a rank share one grad wrapper
        self.model: list[ModelChunk] = schedule_chunks(model)
        # MoE routers, found once; none in a dense model
        self.routers = routers_of([chunk.module for chunk in self.model])
        # a grid tensor-parallel mode cuts the activations between stages along b and h
        batch_split, hidden_split = tensor_parallel_mode(ps).activation_split
        self.forward_backward_func = get_forward_backward_func(
            ps,
            pipeline_schedule=effective_schedule(cfg),
            microbatch_group_size=cfg.parallel.microbatch_group_size_per_virtual_pipeline_stage,
            overlap_p2p=not cfg.parallel.no_overlap_p2p_communication,
            seq_length=cfg.model.seq_length // ps.cp_size,  # context parallel: [s/cp(/tp), b, h]
            micro_batch_size=cfg.training.micro_batch_size // batch_split,
            hidden_size=cfg.model.hidden_size // hidden_split,
            sequence_parallel=cfg.model.sequence_parallel,
            dtype=cfg.model.params_dtype,
        )
        # the mesh's; the cp ranks of a replica share its micro-batches
        self.num_microbatches = cfg.training.num_microbatches(ps.dp_size)
        # --rampup-batch-size / --step-batch-size-schedule: the batch of each iteration from the
        # samples consumed; evaluation keeps the final batch
        self.batch_sizes = batch_size_calculator(
            cfg.training, ps.dp_size, seq_length=cfg.model.seq_length
        )
        self.eval_num_microbatches = self.num_microbatches
        self.current_global_batch_size = cfg.training.global_batch_size
        self.result = TrainResult()
        self.exit_signal: ExitSignalHandler | None = None  # --exit-signal-handler, set by pretrain
        self.progress = Progress(cfg, ps, device)  # the log lines and TensorBoard scalars
        self.stats = DeviceStats(device)
        self.last_stragglers: StragglerReport | None = None
        self.stragglers = (  # --log-straggler: every rank's step times at the log interval
            StragglerMeter(
                rank=ps.rank(),
                world_group=ps.group() if dist.is_initialized() else None,
                slowdown=cfg.logging.straggler_slowdown,
                minmax_count=cfg.logging.straggler_minmax_count,
            )
            if cfg.logging.log_straggler
            else None
        )

    @property
    def is_log_rank(self) -> bool:
        """This rank prints the progress lines (the last rank: the last pipeline stage)."""
        return self.progress.is_log_rank

    @property
    def tensorboard(self) -> TensorBoardLogger:
        """The run's TensorBoard writer (inactive without ``tensorboard_dir``)."""
        return self.progress.tensorboard

    def _schedule_kwargs(self) -> dict:
        return {
            "ps": self.ps,
            "num_microbatches": self.num_microbatches,
            "forward_backward_func": self.forward_backward_func,
        }

    def step(self, forward_step_func: Callable, data_iterator) -> StepResult:
        """One iteration over every model chunk (``data_iterator``: one per chunk, or one); the
        first one runs inside the hooks' ``around_first_step`` contexts, and the first that
        updates the weights calls their ``after_first_update`` (``FirstStepHook``)."""
        with ExitStack() as first_step:
            if not self._stepped:
                self._stepped = True
                for hook in self.first_step_hooks:
                    first_step.enter_context(hook.around_first_step(self))
            result = self._train_step(forward_step_func, data_iterator)
            if result.update_successful and not self._updated:
                self._updated = True
                for hook in self.first_step_hooks:
                    hook.after_first_update(self)
        return result

    def _train_step(self, forward_step_func: Callable, data_iterator) -> StepResult:
        if self.routers:  # MoE aux losses get the lm loss's grad scale (/ micro-batches)
            scale = 1.0 / self.num_microbatches  # no host read: the fp16 scale stays a tensor
            if self.optimizer.loss_scaler is not None:
                scale = self.optimizer.get_loss_scale().reshape(()) * scale
            set_aux_loss_scale(self.routers, scale)
        result = train_step(
            forward_step_func,
            as_list(data_iterator),
            self.model,
            self.optimizer,
            self.scheduler,
            **self._schedule_kwargs(),
            calculate_per_token_loss=self.cfg.training.calculate_per_token_loss,
            # --async-save: the save's copy runs beside forward and backward, not the update
            before_optimizer_step=lambda: checkpoint_io.wait_for_async_copy(self),
        )
        if self.routers:  # aux-loss-free balancing
            update_expert_bias(self.routers, self.ps.group("tp", "dp", "cp"))
        return result

    # --- reading the device-side numbers ----------------------------------------------------------

    def read_stats(self) -> IntervalSnapshot:
        """Read the interval's numbers (collective over the world: every rank, same iteration),
        fold them into ``result`` and stop the run on a non-finite loss or grad norm."""
        snap = self.stats.read(self.ps.group())
        self._read_moe_stats()
        r = self.result
        r.losses.extend(snap.per_step_losses)
        r.grad_norms.extend(snap.per_step_grad_norms)
        r.skipped_iterations += snap.skipped
        r.nan_iterations += snap.nonfinite
        if self.cfg.training.check_for_nan_in_loss_and_grad:
            flag = "pass --no-check-for-nan-in-loss-and-grad to keep going"
            if snap.first_bad_loss is not None:
                raise TrainingError(
                    f"iteration {snap.first_bad_loss}: the loss is not finite (seen at the check "
                    f"after iteration {r.iteration}); lower --lr, check the data, or {flag}"
                )
            if snap.first_bad_grad_norm is not None:
                raise TrainingError(
                    f"iteration {snap.first_bad_grad_norm}: the grad norm is not finite (seen at "
                    f"the check after iteration {r.iteration}); lower --lr or {flag}"
                )
        return snap

    def _read_moe_stats(self) -> None:
        """A MoE model's aux and z losses into the result, the log and TensorBoard (collective
        over the world; nothing for a dense model)."""
        if self.cfg.model.num_experts is None:
            return
        modules = [chunk.module for chunk in self.model]
        layers = read_moe_stats(modules, self.ps, self.cfg.model.num_layers)
        if layers:
            losses = self.progress.moe_losses(layers, self.result.iteration)
            self.result.moe_losses.append(losses)

    # --- the loop ---------------------------------------------------------------------------------

    def train(
        self,
        forward_step_func: Callable,
        train_iter: Iterator | list[Iterator] | None,
        valid_iter: Iterator | list[Iterator] | None = None,
    ) -> TrainResult:
        t, r = self.cfg.training, self.result
        start = time.perf_counter()
        while r.iteration < t.train_iters:
            if not self.batch_sizes.constant:  # a batch-size ramp or schedule
                self._next_batch_size()
            if self.stragglers is not None:
                self.stragglers.begin_step()
            step = self.step(forward_step_func, train_iter)
            if self.stragglers is not None:
                self.stragglers.end_step()
            r.iteration += 1
            r.consumed_train_samples += self.current_global_batch_size
            self.stats.add(
                r.iteration,
                step.losses,
                step.grad_norm,
                step.update_successful,
                num_zeros_in_grad=step.num_zeros_in_grad,
            )
            if r.iteration % self.cfg.logging.tensorboard_log_interval == 0:
                self.progress.step_scalars(
                    r.iteration,
                    step,
                    global_batch_size=self.current_global_batch_size,
                    optimizer=self.optimizer,
                    skipped_iterations=r.skipped_iterations,
                    nan_iterations=r.nan_iterations,
                )
            if r.iteration % self.cfg.logging.log_interval == 0:
                snap = self.read_stats()
                self.progress.interval(
                    step,
                    snap,
                    start=start,
                    iteration=r.iteration,
                    consumed_samples=r.consumed_train_samples,
                    global_batch_size=self.current_global_batch_size,
                    optimizer=self.optimizer,
                )
                if self.stragglers is not None:
                    self._log_stragglers(r.iteration)
                start = time.perf_counter()
            if valid_iter is not None and t.eval_interval and r.iteration % t.eval_interval == 0:
                started = time.perf_counter()
                r.validation = self.evaluate(
                    forward_step_func, valid_iter, f"iteration {r.iteration}"
                )
                r.consumed_valid_samples += t.eval_iters * t.global_batch_size
                start += time.perf_counter() - started  # not training time
            if t.save and t.save_interval and r.iteration % t.save_interval == 0:
                self.save_checkpoint()
            elif checkpoint_io.non_persistent_due(self):  # --non-persistent-save-interval
                self.read_stats()  # a non-finite run stops before it saves
                checkpoint_io.save_non_persistent(self)
            if self.exit_signal is not None and self._exit_on_signal(r.iteration):
                r.exited_on_signal = True
                break
            if t.exit_interval and r.iteration % t.exit_interval == 0:
                logger.info("exiting program at iteration %d (--exit-interval)", r.iteration)
                break
            if exit_duration_reached(self, self.start_time):
                logger.info(
                    "exiting program at iteration %d (--exit-duration-in-mins %s)",
                    r.iteration,
                    t.exit_duration_in_mins,
                )
                break
        self.save_checkpoint()  # the last iteration, unless saved already (Megatron does too)
        checkpoint_io.finish_async_save(self)  # --async-save: the save in flight is committed
        self.read_stats()  # the steps since the last read (a no-op read when there are none)
        return r

    def _log_stragglers(self, iteration: int) -> None:
        """--log-straggler: gather every rank's step times (all ranks), log the slow ones."""
        report = self.stragglers.gather()
        self.last_stragglers = report
        logger.info("iteration %d: %s", iteration, report.line())
        self.tensorboard.scalars(report.scalars(), iteration)

    def _next_batch_size(self) -> None:
        """Under a batch-size ramp: this iteration's global batch from the samples consumed
        before it; the LR schedule advances by it (in final batches). As Megatron, a checkpoint
        is saved (with ``--save``) where the number of micro-batches changes."""
        r, t = self.result, self.cfg.training
        gbs = self.batch_sizes.global_batch_size(r.consumed_train_samples)
        num_microbatches = self.batch_sizes.num_microbatches(r.consumed_train_samples)
        if num_microbatches != self.num_microbatches and r.iteration > 0:
            if self.is_log_rank:
                logger.info(
                    "global batch size %d -> %d at %d consumed samples",
                    self.current_global_batch_size,
                    gbs,
                    r.consumed_train_samples,
                )
            if t.save:
                self.save_checkpoint()
        self.num_microbatches, self.current_global_batch_size = num_microbatches, gbs
        self.scheduler.increment = gbs / t.global_batch_size

    def _exit_on_signal(self, iteration: int) -> bool:
        """At the iteration boundary: whether any rank got the exit signal (one all-reduce over the
        world, so every rank answers the same); if so, save a checkpoint here on every rank."""
        if not any_rank_signalled(
            self.exit_signal.received, group=self.ps.group(), device=self.device
        ):
            return False
        logger.info(
            "exiting program at iteration %d: %s received (--exit-signal-handler); saving",
            iteration,
            self.exit_signal.signum.name,
        )
        self.save_on_exit()
        return True

    def save_on_exit(self) -> None:
        """Save this iteration's checkpoint (``--save``) before an early exit."""
        if self.cfg.training.save is None:
            logger.warning("--exit-signal-handler: no --save directory, so nothing is saved")
            return
        self.save_checkpoint()

    def save_checkpoint(self) -> None:
        """Save the current iteration to ``--save`` unless there is none or it is saved already.
        Every rank calls it at the same iteration boundary (collective). The interval's numbers
        are read first: a run whose loss or grad norm went non-finite stops before it saves."""
        if self.cfg.training.save and self.last_saved_iteration != self.result.iteration:
            self.read_stats()
            checkpoint_io.save_checkpoint(self)

    def evaluate(self, forward_step_func: Callable, data_iter, prefix: str) -> dict:
        return evaluate_and_log(
            forward_step_func,
            as_list(data_iter),
            self.model,
            label=prefix,
            iteration=self.result.iteration,
            tensorboard=self.tensorboard,
            eval_iters=self.cfg.training.eval_iters,
            **{**self._schedule_kwargs(), "num_microbatches": self.eval_num_microbatches},
        )

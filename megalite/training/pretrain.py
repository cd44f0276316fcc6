"""The pretraining loop.

    cfg = parse_args(argv)        # megalite.training.arguments
    result = pretrain(cfg)

``pretrain`` joins the process group the launcher set up (torchrun, srun or a plain process), builds
the mesh, the model stage, the optimizer and the data loaders, then runs ``train_iters`` iterations
of ``train_step`` with Megatron-shaped progress lines every ``--log-interval`` iterations,
TensorBoard scalars every ``--tensorboard-log-interval``, and evaluation every ``--eval-interval``
(plus once on the validation and test sets at the end). Logging and evaluation happen on the last
pipeline stage; nothing else here depends on the layout.

A non-finite loss or grad norm stops the run with ``TrainingError`` naming the iteration
(``--check-for-nan-in-loss-and-grad``, on by default), except on fp16 steps the loss scaler skips.
"""

from __future__ import annotations

import logging
import math
import resource
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from megalite.checkpoint import CheckpointError
from megalite.core.optimizer.memory_report import log_model_state_memory
from megalite.core.parallel_state import ParallelState, initialize_model_parallel
from megalite.core.tensor_parallel.mappings import group_size
from megalite.core.tensor_parallel.random import model_parallel_seed
from megalite.data.builders import build_data_loaders, train_valid_test_num_samples
from megalite.training import checkpoint_io
from megalite.training.checkpoint_io import exit_duration_reached
from megalite.training.components import setup_model_and_optimizer
from megalite.training.config import PretrainConfig, with_tokenizer
from megalite.training.evaluate import evaluate_and_log
from megalite.training.flops import model_flops_per_iteration, peak_tflops, throughput
from megalite.training.forward_step import make_forward_step
from megalite.training.launch import detect_launch, init_distributed, select_device
from megalite.training.logging import IntervalStats, configure_logging, format_iteration_line
from megalite.training.schedules import get_forward_backward_func
from megalite.training.signals import ExitSignalHandler, any_rank_signalled, parse_signal
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


def peak_memory_mib(device: torch.device) -> float:
    """This process's peak: allocated CUDA memory on GPU, max resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def _max_over_mesh(value: float, ps: ParallelState) -> float:
    """Max over every rank: over the model-parallel group, then over DP (TP x PP x DP = world)."""
    t = torch.tensor([value], dtype=torch.float64, device=ps.device)
    for group in (ps.mp_group, ps.dp_group):
        if group_size(group) > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def _is_finite(t: torch.Tensor | None) -> bool:
    return t is None or bool(torch.isfinite(t).all())


class _Interval:
    """Sums over the iterations since the last log line."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.iterations = 0
        self.loss_sums: dict[str, float] = {}
        self.loss_counts = 0
        self.skipped = 0
        self.nan = 0


class Trainer:
    """The loop's state and its pieces; ``pretrain`` builds one, tests may drive it directly."""

    def __init__(self, cfg: PretrainConfig, ps: ParallelState, *, device: torch.device, tracker):
        self.cfg, self.ps, self.device = cfg, ps, device
        self.rng_tracker = tracker  # saved and restored by checkpoints
        self.start_time = time.time()  # for --exit-duration-in-mins
        self.last_saved_iteration: int | None = None  # set by save/load_checkpoint
        self.model, self.optimizer, self.scheduler = setup_model_and_optimizer(
            cfg, ps, device=device, rng_tracker=tracker
        )
        self.forward_backward_func = get_forward_backward_func(
            ps,
            pipeline_schedule=cfg.parallel.pipeline_schedule,
            seq_length=cfg.model.seq_length,
            micro_batch_size=cfg.training.micro_batch_size,
            hidden_size=cfg.model.hidden_size,
            sequence_parallel=cfg.model.sequence_parallel,
            dtype=cfg.model.params_dtype,
        )
        self.num_microbatches = cfg.training.num_microbatches(ps.dp_size)  # the mesh's DP
        self.result = TrainResult()
        self.exit_signal: ExitSignalHandler | None = None  # --exit-signal-handler, set by pretrain
        self.is_log_rank = ps.rank() == ps.world_size - 1  # on the last stage
        self.tensorboard = TensorBoardLogger(
            cfg.logging.tensorboard_dir,
            enabled=self.is_log_rank,
            queue_size=cfg.logging.tensorboard_queue_size,
        )
        m, t = cfg.model, cfg.training
        self.flops_per_iteration = model_flops_per_iteration(
            num_layers=m.num_layers, hidden_size=m.hidden_size, seq_length=m.seq_length,
            global_batch_size=t.global_batch_size,
            padded_vocab_size=m.padded_vocab_size(ps.tp_size),
            ffn_hidden_size=m.ffn_hidden_size, num_attention_heads=m.num_attention_heads,
            kv_channels=m.kv_channels, num_query_groups=m.num_query_groups, swiglu=m.swiglu,
        )  # fmt: skip
        device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
        self.peak = peak_tflops(
            device_name, cfg.optimizer.precision_name, override=cfg.logging.peak_tflops
        )

    def _schedule_kwargs(self) -> dict:
        return {
            "ps": self.ps,
            "num_microbatches": self.num_microbatches,
            "forward_backward_func": self.forward_backward_func,
            "seq_length": self.cfg.model.seq_length,
            "micro_batch_size": self.cfg.training.micro_batch_size,
        }

    def step(self, forward_step_func: Callable, data_iterator: Iterator | None) -> StepResult:
        return train_step(
            forward_step_func,
            [data_iterator],
            [self.model],
            self.optimizer,
            self.scheduler,
            **self._schedule_kwargs(),
        )

    def _check(self, iteration: int, step: StepResult) -> bool:
        """Whether this iteration's loss is finite; raises TrainingError when the run must stop."""
        loss_ok = all(_is_finite(v) for v in step.losses.values())
        if group_size(self.ps.pp_group) > 1:  # only the last stage holds the loss
            flag = torch.tensor([0.0 if loss_ok else 1.0], device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.ps.pp_group)
            loss_ok = flag.item() == 0.0
        if not step.update_successful or not self.cfg.training.check_for_nan_in_loss_and_grad:
            return loss_ok
        if not loss_ok:
            values = ", ".join(f"{k} = {float(v)}" for k, v in step.losses.items())
            raise TrainingError(
                f"iteration {iteration}: the loss is not finite ({values or 'on the last stage'}); "
                "lower --lr, check the data, or pass --no-check-for-nan-in-loss-and-grad"
            )
        if not _is_finite(step.grad_norm):
            raise TrainingError(
                f"iteration {iteration}: the grad norm is {float(step.grad_norm)}; lower --lr "
                "or pass --no-check-for-nan-in-loss-and-grad"
            )
        return True

    def train(
        self,
        forward_step_func: Callable,
        train_iter: Iterator | None,
        valid_iter: Iterator | None = None,
    ) -> TrainResult:
        t, r = self.cfg.training, self.result
        interval = _Interval()
        while r.iteration < t.train_iters:
            step = self.step(forward_step_func, train_iter)
            r.iteration += 1
            r.consumed_train_samples += t.global_batch_size
            loss_ok = self._check(r.iteration, step)
            interval.iterations += 1
            if not step.update_successful:
                interval.skipped += 1
                r.skipped_iterations += 1
            if not loss_ok:
                interval.nan += 1
                r.nan_iterations += 1
            elif step.update_successful and step.losses:
                for name, value in step.losses.items():
                    interval.loss_sums[name] = interval.loss_sums.get(name, 0.0) + value
                interval.loss_counts += 1
            r.grad_norms.append(math.nan if step.grad_norm is None else step.grad_norm)
            if step.losses:
                r.losses.append(step.losses["lm loss"] if "lm loss" in step.losses else math.nan)
            if r.iteration % self.cfg.logging.tensorboard_log_interval == 0:
                self._tensorboard_step(r.iteration, step)
            if r.iteration % self.cfg.logging.log_interval == 0:
                self._log_interval(step, interval)
                interval = _Interval()
            if valid_iter is not None and t.eval_interval and r.iteration % t.eval_interval == 0:
                started = time.perf_counter()
                r.validation = self.evaluate(
                    forward_step_func, valid_iter, f"iteration {r.iteration}"
                )
                r.consumed_valid_samples += t.eval_iters * t.global_batch_size
                interval.start += time.perf_counter() - started  # not training time
            if t.save and t.save_interval and r.iteration % t.save_interval == 0:
                self.save_checkpoint()
            if self.exit_signal is not None and self._exit_on_signal(r.iteration):
                r.exited_on_signal = True
                break
            if t.exit_interval and r.iteration % t.exit_interval == 0:
                logger.info("exiting program at iteration %d (--exit-interval)", r.iteration)
                break
            if exit_duration_reached(self, self.start_time):
                logger.info(
                    "exiting program at iteration %d (--exit-duration-in-mins %s)",
                    r.iteration, t.exit_duration_in_mins,
                )  # fmt: skip
                break
        self.save_checkpoint()  # the last iteration, unless saved already (Megatron does too)
        r.losses = [float(v) for v in r.losses]
        r.grad_norms = [float(v) for v in r.grad_norms]
        return r

    def _exit_on_signal(self, iteration: int) -> bool:
        """At the iteration boundary: whether any rank got the exit signal (one all-reduce over the
        world, so every rank answers the same); if so, save a checkpoint here on every rank."""
        if not any_rank_signalled(
            self.exit_signal.received, group=self.ps.group(), device=self.device
        ):
            return False
        logger.info(
            "exiting program at iteration %d: %s received (--exit-signal-handler); saving",
            iteration, self.exit_signal.signum.name,
        )  # fmt: skip
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
        Every rank calls it at the same iteration boundary (collective)."""
        if self.cfg.training.save and self.last_saved_iteration != self.result.iteration:
            checkpoint_io.save_checkpoint(self)

    def evaluate(self, forward_step_func: Callable, data_iter: Iterator, prefix: str) -> dict:
        return evaluate_and_log(
            forward_step_func,
            data_iter,
            self.model,
            label=prefix,
            iteration=self.result.iteration,
            tensorboard=self.tensorboard,
            eval_iters=self.cfg.training.eval_iters,
            **self._schedule_kwargs(),
        )

    def _tensorboard_step(self, iteration: int, step: StepResult) -> None:
        if not self.tensorboard.active:
            return
        values = {name: float(v) for name, v in step.losses.items()}
        values.update({
            "learning-rate": step.learning_rate,
            "batch-size": self.cfg.training.global_batch_size,
            "loss-scale": float(self.optimizer.get_loss_scale().item()),
            "grad-norm": None if step.grad_norm is None else float(step.grad_norm),
            "num-skipped-iterations": self.result.skipped_iterations,
            "num-nan-iterations": self.result.nan_iterations,
        })  # fmt: skip
        self.tensorboard.scalars(values, iteration)

    def _log_interval(self, step: StepResult, interval: _Interval) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = (time.perf_counter() - interval.start) / interval.iterations
        memory = _max_over_mesh(peak_memory_mib(self.device), self.ps)
        if not self.is_log_rank:
            return
        cfg, r = self.cfg, self.result
        tflops, mfu = throughput(
            self.flops_per_iteration, seconds, world_size=self.ps.world_size, peak=self.peak
        )
        tokens_per_second = cfg.training.global_batch_size * cfg.model.seq_length / seconds
        stats = IntervalStats(
            iteration=r.iteration,
            train_iters=cfg.training.train_iters,
            consumed_samples=r.consumed_train_samples,
            ms_per_iteration=seconds * 1000.0,
            learning_rate=step.learning_rate,
            global_batch_size=cfg.training.global_batch_size,
            losses={
                k: float(v) / max(interval.loss_counts, 1) for k, v in interval.loss_sums.items()
            },
            loss_scale=float(self.optimizer.get_loss_scale().item()),
            grad_norm=None if step.grad_norm is None else float(step.grad_norm),
            skipped_iterations=interval.skipped,
            nan_iterations=interval.nan,
            tokens_per_second=tokens_per_second,
            tflops_per_device=tflops,
            mfu_percent=mfu,
            peak_memory_mib=memory,
        )
        logger.info(format_iteration_line(stats))
        self.tensorboard.scalars(
            {
                "iteration-time": seconds,
                "tokens-per-second": tokens_per_second,
                "tflops-per-device": tflops,
                "mfu": mfu,
                "peak-memory-mib": memory,
            },
            r.iteration,
        )


def _exit_signal_handler(cfg: PretrainConfig) -> ExitSignalHandler | None:
    """The installed handler when ``--exit-signal-handler`` is on, else None."""
    t = cfg.training
    if not getattr(t, "exit_signal_handler", False):
        return None
    handler = ExitSignalHandler(parse_signal(getattr(t, "exit_signal", "SIGTERM"))).install()
    logger.info("--exit-signal-handler: %s saves a checkpoint and exits", handler.signum.name)
    return handler


def pretrain(
    cfg: PretrainConfig, *, forward_step_func: Callable | None = None, env=None
) -> TrainResult:
    """Run the whole job described by ``cfg``; returns the summary (losses on the last stage)."""
    cfg = with_tokenizer(cfg)  # validates; builds the tokenizer unless set
    launch = detect_launch(env)
    device = select_device(cfg.parallel.device, launch.local_rank)
    owns_world = not dist.is_initialized()
    init_distributed(launch, device, timeout_minutes=cfg.parallel.distributed_timeout_minutes)
    ps = initialize_model_parallel(
        cfg.parallel.tensor_model_parallel_size,
        cfg.parallel.pipeline_model_parallel_size,
        device=device,
        timeout=timedelta(minutes=cfg.parallel.distributed_timeout_minutes),
    )
    configure_logging(rank=ps.rank(), log_rank=ps.world_size - 1)
    trainer = None
    exit_signal = None
    try:
        num_microbatches = cfg.check_world(ps.world_size, ps.dp_size)  # before any data is read
        exit_signal = _exit_signal_handler(cfg)
        logger.info(
            "megalite: world %d = TP %d x PP %d x DP %d on %s (%s), %d micro-batches of %d per "
            "DP rank per iteration",
            ps.world_size, ps.tp_size, ps.pp_size, ps.dp_size, device, ps.backend,
            num_microbatches, cfg.training.micro_batch_size,
        )  # fmt: skip
        tracker = model_parallel_seed(
            cfg.training.seed, tp_rank=ps.tp_rank, pp_rank=ps.pp_rank, device=device
        )
        trainer = Trainer(cfg, ps, device=device, tracker=tracker)
        trainer.exit_signal = exit_signal
        n_params = sum(p.numel() for p in trainer.model.parameters())
        logger.info("parameters on the last rank: %d", n_params)
        log_model_state_memory(trainer.model, trainer.optimizer, ps)
        t = cfg.training
        try:
            loaded = checkpoint_io.load_checkpoint(trainer) if t.load else None
        except CheckpointError as e:  # one line for pretrain_gpt.py to print
            raise TrainingError(str(e)) from None
        samples = train_valid_test_num_samples(
            train_iters=t.train_iters,
            global_batch_size=t.global_batch_size,
            eval_interval=t.eval_interval,
            eval_iters=t.eval_iters,
        )
        train_iter, valid_iter, test_iter = build_data_loaders(
            cfg.data,
            tokenizer=cfg.tokenizer,
            micro_batch_size=t.micro_batch_size,
            global_batch_size=t.global_batch_size,
            dp_rank=ps.dp_rank,
            dp_size=ps.dp_size,
            train_samples=samples[0],
            valid_samples=samples[1],
            test_samples=samples[2],
            consumed_train_samples=trainer.result.consumed_train_samples,
            consumed_valid_samples=trainer.result.consumed_valid_samples,
            device=device,
            build_cache=launch.local_rank == 0,
            barrier=dist.barrier,
        )
        if loaded is not None:  # last: building the loaders may draw from the generators
            checkpoint_io.restore_rng(trainer, loaded)
        forward_step = forward_step_func or make_forward_step(device)
        result = trainer.train(forward_step, train_iter, valid_iter if t.eval_iters else None)
        if t.eval_iters > 0 and not result.exited_on_signal:
            prefix = f"iteration {result.iteration}"
            if valid_iter is not None:
                result.validation = trainer.evaluate(
                    forward_step, valid_iter, f"{prefix} on validation set"
                )
            if test_iter is not None:
                result.test = trainer.evaluate(forward_step, test_iter, f"{prefix} on test set")
        logger.info("training done: %d iterations", result.iteration)
        return result
    finally:
        if exit_signal is not None:
            exit_signal.restore()
        if trainer is not None:
            trainer.tensorboard.close()
        ps.destroy()
        if owns_world and dist.is_initialized():
            dist.destroy_process_group()

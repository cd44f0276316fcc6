"""The training loop over a built run: steps, progress lines, evaluation, checkpoints, exits.

    trainer = Trainer(cfg, ps, device=device, tracker=tracker)   # model chunks, optimizer, ...
    result = trainer.train(forward_step_func, [train_iter], [valid_iter])

A step reads nothing back from the device: losses, counters and the NaN/inf watch accumulate in
``step_stats.DeviceStats`` and are read every ``--log-interval`` iterations, before every
checkpoint and at the end (one device -> host copy each time). So a non-finite loss or grad norm
stops the run (``TrainingError`` naming the first such iteration,
``--check-for-nan-in-loss-and-grad``, on by default) at the next read, and never reaches a saved
checkpoint. fp16 steps the loss scaler skips are counted, not fatal. Logging happens on the last
rank (the last pipeline stage); nothing else here depends on the layout.
"""

from __future__ import annotations

import logging
import math
import resource
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megalite.core.groups import group_size
from megalite.core.moe import routers_of, set_aux_loss_scale, update_expert_bias
from megalite.core.parallel_state import ParallelState
from megalite.core.pipeline_parallel.forward_backward import get_forward_backward_func
from megalite.models.moe_layer import read_moe_stats
from megalite.training import checkpoint_io
from megalite.training.checkpoint_io import exit_duration_reached
from megalite.training.components import setup_model_and_optimizer
from megalite.training.config import PretrainConfig
from megalite.training.evaluate import evaluate_and_log
from megalite.training.flops import model_flops_per_iteration, peak_tflops, throughput
from megalite.training.logging import IntervalStats, format_iteration_line
from megalite.training.microbatches import batch_size_calculator  # issue 18
from megalite.training.model_chunks import effective_schedule, schedule_chunks
from megalite.training.signals import ExitSignalHandler, any_rank_signalled
from megalite.training.step_stats import DeviceStats, IntervalSnapshot
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
    # issue 16: per read of the numbers (each --log-interval), MoE models only: the mean over MoE
    # layers of each layer's load-balancing and z loss (per micro-batch, coefficient included)
    moe_losses: list[dict[str, float]] = field(default_factory=list)


def peak_memory_mib(device: torch.device) -> float:
    """This process's peak: allocated CUDA memory on GPU, max resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def max_over_world(value: float, ps: ParallelState) -> float:
    """The largest ``value`` of any rank (one all-reduce over the world group)."""
    t = torch.tensor([value], dtype=torch.float64, device=ps.device)
    if group_size(ps.group()) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ps.group())
    return float(t.item())


def as_list(x) -> list:
    """A model chunk / data iterator, or a list of them (one per virtual stage), as a list."""
    return list(x) if isinstance(x, (list, tuple)) else [x]


class Trainer:
    """The loop's state and its pieces; ``pretrain.build_run`` builds one, tests may too.

    ``model`` is the list of this rank's model chunks (data-parallel wrappers; one without virtual
    pipeline stages), ``optimizer`` covers all of them."""

    def __init__(self, cfg: PretrainConfig, ps: ParallelState, *, device: torch.device, tracker):
        self.cfg, self.ps, self.device = cfg, ps, device
        self.rng_tracker = tracker  # saved and restored by checkpoints
        self.start_time = time.time()  # for --exit-duration-in-mins
        self.last_saved_iteration: int | None = None  # set by save/load_checkpoint
        model, self.optimizer, self.scheduler = setup_model_and_optimizer(
            cfg, ps, device=device, rng_tracker=tracker
        )
        self.model: list[torch.nn.Module] = schedule_chunks(model)  # a view per chunk (issue 14)
        self.routers = routers_of(self.model)  # issue 16: found once; none in a dense model
        self.forward_backward_func = get_forward_backward_func(
            ps,
            pipeline_schedule=effective_schedule(cfg),
            num_chunks=len(self.model),
            microbatch_group_size=cfg.parallel.microbatch_group_size_per_virtual_pipeline_stage,
            overlap_p2p=not cfg.parallel.no_overlap_p2p_communication,
            seq_length=cfg.model.seq_length // ps.cp_size,  # issue 15: [s/cp(/tp), b, h]
            micro_batch_size=cfg.training.micro_batch_size,
            hidden_size=cfg.model.hidden_size,
            sequence_parallel=cfg.model.sequence_parallel,
            dtype=cfg.model.params_dtype,
        )
        # the mesh's; the cp ranks of a replica share its micro-batches (issue 15)
        self.num_microbatches = cfg.training.num_microbatches(ps.dp_size)
        # issue 18: --rampup-batch-size / --step-batch-size-schedule; evaluation keeps the final
        self.batch_sizes = batch_size_calculator(
            cfg.training, ps.dp_size, seq_length=cfg.model.seq_length
        )
        self.eval_num_microbatches = self.num_microbatches
        self.current_global_batch_size = cfg.training.global_batch_size
        self.result = TrainResult()
        self.exit_signal: ExitSignalHandler | None = None  # --exit-signal-handler, set by pretrain
        self.is_log_rank = ps.rank() == ps.world_size - 1  # on the last stage
        self.tensorboard = TensorBoardLogger(
            cfg.logging.tensorboard_dir,
            enabled=self.is_log_rank,
            queue_size=cfg.logging.tensorboard_queue_size,
        )
        self.stats = DeviceStats(device)
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

    def step(self, forward_step_func: Callable, data_iterator) -> StepResult:
        """One iteration over every model chunk (``data_iterator``: one per chunk, or one)."""
        if self.routers:  # issue 16: aux losses get the lm loss's grad scale (/ micro-batches)
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
            calculate_per_token_loss=self.cfg.training.calculate_per_token_loss,  # issue 18
        )
        if self.routers:  # aux-loss-free balancing
            update_expert_bias(self.routers, self.ps.group("tp", "dp", "cp"))
        return result

    # --- reading the device-side numbers ----------------------------------------------------------

    def read_stats(self) -> IntervalSnapshot:
        """Read the interval's numbers (collective over the world: every rank, same iteration),
        fold them into ``result`` and stop the run on a non-finite loss or grad norm."""
        snap = self.stats.read(self.ps.group())
        self._read_moe_stats()  # issue 16
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
        """Issue 16: aux / z loss into the result, the log and TensorBoard (with a histogram of
        tokens per expert per layer). Collective over the world; nothing for a dense model."""
        if self.cfg.model.num_experts is None:
            return
        layers = read_moe_stats(self.model, self.ps, self.cfg.model.num_layers)
        if not layers:
            return
        aux = sum(v[0] for v in layers.values()) / len(layers)
        z = sum(v[1] for v in layers.values()) / len(layers)
        self.result.moe_losses.append({"load_balancing_loss": aux, "z_loss": z})
        if not self.is_log_rank:
            return
        logger.info(" moe: load_balancing_loss %.6E | z_loss %.6E", aux, z)
        writer, it = self.tensorboard.writer, self.result.iteration
        if writer is not None:
            writer.add_scalar("load_balancing_loss", aux, it)
            writer.add_scalar("z_loss", z, it)
            for layer, (_, _, counts) in layers.items():
                experts = torch.arange(counts.numel(), dtype=torch.float64)
                writer.add_histogram_raw(
                    f"tokens-per-expert/layer-{layer}", min=0, max=counts.numel(),
                    num=float(counts.sum()), sum=float((experts * counts).sum()),
                    sum_squares=float((experts**2 * counts).sum()),
                    bucket_limits=(experts + 1).tolist(), bucket_counts=counts.tolist(),
                    global_step=it,
                )  # fmt: skip

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
            if not self.batch_sizes.constant:  # issue 18
                self._next_batch_size()
            step = self.step(forward_step_func, train_iter)
            r.iteration += 1
            r.consumed_train_samples += self.current_global_batch_size
            self.stats.add(
                r.iteration, step.losses, step.grad_norm, step.update_successful,
                num_zeros_in_grad=step.num_zeros_in_grad,  # issue 18
            )  # fmt: skip
            if r.iteration % self.cfg.logging.tensorboard_log_interval == 0:
                self._tensorboard_step(r.iteration, step)
            if r.iteration % self.cfg.logging.log_interval == 0:
                self._log_interval(step, self.read_stats(), start)
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
        self.read_stats()  # the steps since the last read (a no-op read when there are none)
        return r

    def _next_batch_size(self) -> None:
        """Issue 18: this iteration's global batch from the samples consumed before it; the
        schedule advances by it (in final batches). As Megatron, a checkpoint is saved (with
        ``--save``) where the number of micro-batches changes."""
        r, t = self.result, self.cfg.training
        gbs = self.batch_sizes.global_batch_size(r.consumed_train_samples)
        num_microbatches = self.batch_sizes.num_microbatches(r.consumed_train_samples)
        if num_microbatches != self.num_microbatches and r.iteration > 0:
            if self.is_log_rank:
                logger.info(
                    "global batch size %d -> %d at %d consumed samples",
                    self.current_global_batch_size, gbs, r.consumed_train_samples,
                )  # fmt: skip
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

    # --- output -----------------------------------------------------------------------------------

    def _tensorboard_step(self, iteration: int, step: StepResult) -> None:
        """Per-step scalars (``--tensorboard-log-interval``: reading them is a host sync)."""
        if not self.tensorboard.active:
            return
        values = {name: float(v) for name, v in step.losses.items()}
        values.update({
            "learning-rate": step.learning_rate,
            "batch-size": self.current_global_batch_size,  # issue 18: under a ramp, this step's
            "loss-scale": float(self.optimizer.get_loss_scale().item()),
            "grad-norm": None if step.grad_norm is None else float(step.grad_norm),
            "num-skipped-iterations": self.result.skipped_iterations,
            "num-nan-iterations": self.result.nan_iterations,
        })  # fmt: skip
        if step.num_zeros_in_grad is not None:  # issue 18: --log-num-zeros-in-grad
            values["num-zeros"] = float(step.num_zeros_in_grad)
        self.tensorboard.scalars(values, iteration)

    def _log_interval(self, step: StepResult, snap: IntervalSnapshot, start: float) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = (time.perf_counter() - start) / max(snap.iterations, 1)
        memory = max_over_world(peak_memory_mib(self.device), self.ps)
        if not self.is_log_rank:
            return
        cfg, r = self.cfg, self.result
        gbs = self.current_global_batch_size  # issue 18: under a ramp, the last step's
        tflops, mfu = throughput(
            self.flops_per_iteration * gbs / cfg.training.global_batch_size, seconds,
            world_size=self.ps.world_size, peak=self.peak,
        )  # fmt: skip
        tokens_per_second = gbs * cfg.model.seq_length / seconds
        grad_norm = snap.per_step_grad_norms[-1] if snap.per_step_grad_norms else math.nan
        stats = IntervalStats(
            iteration=r.iteration,
            train_iters=cfg.training.train_iters,
            consumed_samples=r.consumed_train_samples,
            ms_per_iteration=seconds * 1000.0,
            learning_rate=step.learning_rate,
            global_batch_size=gbs,
            losses=snap.losses,
            loss_scale=float(self.optimizer.get_loss_scale().item()),
            grad_norm=None if math.isnan(grad_norm) else grad_norm,
            skipped_iterations=snap.skipped,
            nan_iterations=snap.nonfinite,
            tokens_per_second=tokens_per_second,
            tflops_per_device=tflops,
            mfu_percent=mfu,
            peak_memory_mib=memory,
            num_zeros_in_grad=snap.num_zeros_in_grad,  # issue 18
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

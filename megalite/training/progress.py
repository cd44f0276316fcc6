"""What the training loop reports: the iteration line every ``--log-interval``, the TensorBoard
scalars of each step, and a MoE model's losses with its tokens per expert.

    progress = Progress(cfg, ps, device)    # the Trainer builds one
    progress.interval(step, snap, start=..., iteration=..., ...)

Lines and scalars come from the logging rank (the last rank, on the last pipeline stage, which
holds the loss); the peak memory of the line is the largest of any rank (a collective).
"""

from __future__ import annotations

import logging
import math
import resource
import time

import torch
import torch.distributed as dist

from megalite.core.groups import group_size
from megalite.core.optimizer import MixedPrecisionOptimizer
from megalite.core.parallel_state import ParallelState
from megalite.models.attention_mask import attention_fraction
from megalite.training.config import PretrainConfig
from megalite.training.flops import model_flops_per_iteration, peak_tflops, throughput
from megalite.training.logging import IntervalStats, format_iteration_line
from megalite.training.step_stats import IntervalSnapshot
from megalite.training.tensorboard import TensorBoardLogger
from megalite.training.train_step import StepResult

logger = logging.getLogger(__name__)


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


class Progress:
    """The run's output: the log lines and TensorBoard writer of the logging rank, and the model
    FLOPs and device peak its throughput figures divide by."""

    def __init__(self, cfg: PretrainConfig, ps: ParallelState, device: torch.device):
        self.cfg, self.ps, self.device = cfg, ps, device
        self.is_log_rank = ps.rank() == ps.world_size - 1  # on the last stage
        self.tensorboard = TensorBoardLogger(
            cfg.logging.tensorboard_dir,
            enabled=self.is_log_rank,
            queue_size=cfg.logging.tensorboard_queue_size,
        )
        m = cfg.model
        self.flops_per_iteration = model_flops_per_iteration(
            num_layers=m.num_layers,
            hidden_size=m.hidden_size,
            seq_length=m.seq_length,
            global_batch_size=cfg.training.global_batch_size,
            padded_vocab_size=m.padded_vocab_size(ps.tp_size),
            ffn_hidden_size=m.ffn_hidden_size,
            num_attention_heads=m.num_attention_heads,
            kv_channels=m.kv_channels,
            num_query_groups=m.num_query_groups,
            swiglu=m.swiglu,
            attention_fraction=attention_fraction(m),
        )
        if m.block_sparse and self.is_log_rank:
            logger.info(
                "model FLOPs (TFLOP/s, MFU) count only the computed attention blocks: "
                f"{100 * attention_fraction(m):.1f}% of the s x s scores"
            )
        device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
        precision = cfg.model.precision_name
        self.peak = peak_tflops(device_name, precision, override=cfg.logging.peak_tflops)

    def step_scalars(
        self,
        iteration: int,
        step: StepResult,
        *,
        global_batch_size: int,
        optimizer: MixedPrecisionOptimizer,
        skipped_iterations: int,
        nan_iterations: int,
    ) -> None:
        """Per-step scalars (``--tensorboard-log-interval``: reading them is a host sync, done
        only when a writer is open). ``global_batch_size``: this step's (under a ramp)."""
        if not self.tensorboard.active:
            return
        values = {name: float(v) for name, v in step.losses.items()}
        grad_norm = None if step.grad_norm is None else float(step.grad_norm)
        values.update(
            {
                "learning-rate": step.learning_rate,
                "batch-size": global_batch_size,
                "loss-scale": float(optimizer.get_loss_scale().item()),
                "grad-norm": grad_norm,
                "num-skipped-iterations": skipped_iterations,
                "num-nan-iterations": nan_iterations,
            }
        )
        if step.num_zeros_in_grad is not None:  # --log-num-zeros-in-grad
            values["num-zeros"] = float(step.num_zeros_in_grad)
        values.update(optimizer.comm_scalars())  # the compressed optimizers' phase and bytes
        self.tensorboard.scalars(values, iteration)

    def interval(
        self,
        step: StepResult,
        snap: IntervalSnapshot,
        *,
        start: float,
        iteration: int,
        consumed_samples: int,
        global_batch_size: int,
        optimizer: MixedPrecisionOptimizer,
    ) -> None:
        """The iteration line and its scalars for the interval that began at ``start``
        (``time.perf_counter``); ``step``: its last step, ``global_batch_size`` that step's.
        Collective over the world (the peak memory)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = (time.perf_counter() - start) / max(snap.iterations, 1)
        memory = max_over_world(peak_memory_mib(self.device), self.ps)
        if not self.is_log_rank:
            return
        cfg, gbs = self.cfg, global_batch_size
        flops = self.flops_per_iteration * gbs / cfg.training.global_batch_size
        tflops, mfu = throughput(flops, seconds, world_size=self.ps.world_size, peak=self.peak)
        tokens_per_second = gbs * cfg.model.seq_length / seconds
        grad_norm = snap.per_step_grad_norms[-1] if snap.per_step_grad_norms else math.nan
        stats = IntervalStats(
            iteration=iteration,
            train_iters=cfg.training.train_iters,
            consumed_samples=consumed_samples,
            ms_per_iteration=seconds * 1000.0,
            learning_rate=step.learning_rate,
            global_batch_size=gbs,
            losses=snap.losses,
            loss_scale=float(optimizer.get_loss_scale().item()),
            grad_norm=None if math.isnan(grad_norm) else grad_norm,
            skipped_iterations=snap.skipped,
            nan_iterations=snap.nonfinite,
            tokens_per_second=tokens_per_second,
            tflops_per_device=tflops,
            mfu_percent=mfu,
            peak_memory_mib=memory,
            num_zeros_in_grad=snap.num_zeros_in_grad,
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
            iteration,
        )

    def moe_losses(self, layers: dict, iteration: int) -> dict[str, float]:
        """The mean over MoE layers of each layer's load-balancing and z loss
        (``models.moe_layer.read_moe_stats``: layer -> (aux, z, tokens per expert)), logged with
        a TensorBoard histogram of tokens per expert per layer."""
        aux = sum(v[0] for v in layers.values()) / len(layers)
        z = sum(v[1] for v in layers.values()) / len(layers)
        losses = {"load_balancing_loss": aux, "z_loss": z}
        if not self.is_log_rank:
            return losses
        logger.info(" moe: load_balancing_loss %.6E | z_loss %.6E", aux, z)
        writer = self.tensorboard.writer
        if writer is None:
            return losses
        writer.add_scalar("load_balancing_loss", aux, iteration)
        writer.add_scalar("z_loss", z, iteration)
        for layer, (_, _, counts) in layers.items():
            experts = torch.arange(counts.numel(), dtype=torch.float64)
            writer.add_histogram_raw(
                f"tokens-per-expert/layer-{layer}",
                min=0,
                max=counts.numel(),
                num=float(counts.sum()),
                sum=float((experts * counts).sum()),
                sum_squares=float((experts**2 * counts).sum()),
                bucket_limits=(experts + 1).tolist(),
                bucket_counts=counts.tolist(),
                global_step=iteration,
            )
        return losses

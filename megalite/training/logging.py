"""Rank-aware logging and the Megatron-shaped progress lines.

``configure_logging(rank=..., log_rank=...)`` sends the ``megalite`` loggers' INFO records to
stdout on ``log_rank`` only (the last rank, on the last pipeline stage, which holds the loss), and
WARNING and above from every rank, prefixed with the rank. ``log_on_all_ranks()`` lifts the
filter (debugging).
"""

from __future__ import annotations

import logging
import math
import sys
from dataclasses import dataclass

LOGGER_NAME = "megalite"


class _RankFilter(logging.Filter):
    def __init__(self, rank: int, log_rank: int):
        super().__init__()
        self.rank, self.log_rank, self.all_ranks = rank, log_rank, False

    def filter(self, record: logging.LogRecord) -> bool:
        return self.all_ranks or self.rank == self.log_rank or record.levelno >= logging.WARNING


def configure_logging(*, rank: int, log_rank: int, level: int = logging.INFO) -> logging.Logger:
    """Install one stdout handler on the ``megalite`` logger (idempotent: a second call replaces
    it). INFO lines print bare on ``log_rank``; warnings carry ``[rank N]``."""
    logger = logging.getLogger(LOGGER_NAME)
    for handler in list(logger.handlers):
        if isinstance(handler, _StdoutHandler):
            logger.removeHandler(handler)
    handler = _StdoutHandler(sys.stdout)
    handler.addFilter(_RankFilter(rank, log_rank))
    handler.setFormatter(_Formatter(rank))
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
    return logger


def log_on_all_ranks(enabled: bool = True) -> None:
    for handler in logging.getLogger(LOGGER_NAME).handlers:
        for f in handler.filters:
            if isinstance(f, _RankFilter):
                f.all_ranks = enabled


class _StdoutHandler(logging.StreamHandler):
    """The handler ``configure_logging`` installs (and replaces on a second call)."""


class _Formatter(logging.Formatter):
    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.levelno >= logging.WARNING:
            return f"[rank {self.rank}] {record.levelname.lower()}: {message}"
        return message


@dataclass
class IntervalStats:
    """What one log line reports, averaged over the iterations of the interval."""

    iteration: int
    train_iters: int
    consumed_samples: int
    ms_per_iteration: float
    learning_rate: float
    global_batch_size: int
    losses: dict[str, float]  # name -> mean over the interval's non-skipped iterations
    loss_scale: float
    grad_norm: float | None
    skipped_iterations: int
    nan_iterations: int
    tokens_per_second: float
    tflops_per_device: float
    mfu_percent: float | None
    peak_memory_mib: float
    num_zeros_in_grad: float | None = None  # --log-num-zeros-in-grad (the last step's)


def format_iteration_line(s: IntervalStats) -> str:
    """One progress line in Megatron-LM's shape (loss ``%.6E``, fields separated by `` | ``)."""
    parts = [
        f" iteration {s.iteration:8d}/{s.train_iters:8d}",
        f"consumed samples: {s.consumed_samples:12d}",
        f"elapsed time per iteration (ms): {s.ms_per_iteration:.1f}",
        f"learning rate: {s.learning_rate:.6E}",
        f"global batch size: {s.global_batch_size:5d}",
    ]
    parts += [f"{name}: {value:.6E}" for name, value in s.losses.items()]
    parts.append(f"loss scale: {s.loss_scale:.1f}")
    if s.grad_norm is not None:
        parts.append(f"grad norm: {s.grad_norm:.3f}")
    if s.num_zeros_in_grad is not None:  # Megatron's field, after the grad norm
        parts.append(f"num zeros: {s.num_zeros_in_grad:.1f}")
    parts += [
        f"number of skipped iterations: {s.skipped_iterations:3d}",
        f"number of nan iterations: {s.nan_iterations:3d}",
        f"tokens/s: {s.tokens_per_second:.0f}",
        f"TFLOP/s per device: {s.tflops_per_device:.3f}",
        "MFU: n/a" if s.mfu_percent is None else f"MFU: {s.mfu_percent:.2f}%",
        f"peak memory per rank (MiB): {s.peak_memory_mib:.1f}",
    ]
    return " | ".join(parts) + " |"


def format_validation_line(prefix: str, losses: dict[str, float]) -> str:
    """``validation loss at {prefix} | lm loss value: %E | lm loss PPL: %E |`` framed by dashes;
    ``prefix`` is "iteration N" (or "iteration N on test set"). PPL = exp(min(20, loss)), as in
    Megatron-LM."""
    fields = " | ".join(
        f"{name} value: {value:.6E} | {name} PPL: {math.exp(min(20.0, value)):.6E}"
        for name, value in losses.items()
    )
    body = f" validation loss at {prefix} | {fields} |"
    rule = "-" * len(body)
    return f"{rule}\n{body}\n{rule}"

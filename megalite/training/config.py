"""The per-concern configuration dataclasses of a pretraining run.

``pretrain_gpt.py`` parses Megatron's flags (``megalite.training.arguments``) into one
``PretrainConfig`` made of: ``model`` (``GPTConfig``), ``parallel``, ``optimizer`` (with mixed
precision and loss scaling), ``data`` (``DataConfig``), ``training`` and ``logging``. Every field is
named after its flag (``--lr-warmup-iters`` is ``lr_warmup_iters``). Invalid combinations raise
``ConfigError`` with one line that names the flags and numbers; the entry point prints it and
exits 2.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megalite.data.config import DataConfig
from megalite.models.config import GPTConfig


class ConfigError(ValueError):
    """A bad flag or flag combination; the message is one line, ready to print after ``error: ``."""


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    pipeline_schedule: str = "1f1b"  # or "gpipe"
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False
    ddp_bucket_size: int | None = None  # elements; None: max(40M, 1M x dp)
    accumulate_allreduce_grads_in_fp32: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False  # ZeRO-1: all-gather a bucket before its first use
    distributed_timeout_minutes: float = 10.0
    device: str = "auto"  # auto | cpu | cuda
    world_size: int = 1  # from the launcher's environment

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // (
            self.tensor_model_parallel_size * self.pipeline_model_parallel_size
        )

    def bucket_size(self) -> int:
        if self.ddp_bucket_size is not None:
            return self.ddp_bucket_size
        return max(40_000_000, 1_000_000 * self.data_parallel_size)


@dataclass
class OptimizerConfig:
    """AdamW, its LR schedule, clipping, and mixed precision (bf16 / fp16 with loss scaling)."""

    lr: float = 1e-4
    min_lr: float = 0.0
    lr_decay_style: str = "linear"
    lr_decay_iters: int | None = None  # None: train_iters
    lr_warmup_iters: int = 0
    lr_warmup_fraction: float | None = None
    lr_warmup_init: float = 0.0
    weight_decay: float = 0.01
    clip_grad: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    bf16: bool = False
    fp16: bool = False
    loss_scale: float | None = None  # constant scale; None: dynamic
    initial_loss_scale: float = 2.0**32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2

    @property
    def params_dtype(self) -> torch.dtype:
        if self.bf16:
            return torch.bfloat16
        if self.fp16:
            return torch.float16
        return torch.float32

    @property
    def precision_name(self) -> str:
        return "bf16" if self.bf16 else "fp16" if self.fp16 else "fp32"

    def warmup_iters(self, decay_iters: int) -> float:
        if self.lr_warmup_fraction is not None:  # Megatron: a fraction of the decay samples
            return self.lr_warmup_fraction * decay_iters
        return self.lr_warmup_iters


@dataclass
class TrainingConfig:
    micro_batch_size: int = 1
    global_batch_size: int = 1
    train_iters: int = 1
    seed: int = 1234
    eval_interval: int = 1000
    eval_iters: int = 100
    check_for_nan_in_loss_and_grad: bool = True
    exit_interval: int | None = None
    save: str | None = None
    load: str | None = None
    save_interval: int | None = None
    # checkpointing (megalite.training.checkpointing)
    ckpt_step: int | None = None  # load this iteration instead of the tracker's
    no_save_optim: bool = False
    no_load_optim: bool = False
    no_load_rng: bool = False
    finetune: bool = False  # weights only; iteration and data position start at 0
    exit_duration_in_mins: float | None = None
    keep_last_n_checkpoints: int | None = None
    exit_signal_handler: bool = False  # --exit-signal-handler: save and exit 0 on the signal
    exit_signal: str = "SIGTERM"  # --exit-signal

    def num_microbatches(self, dp_size: int) -> int:
        return self.global_batch_size // (self.micro_batch_size * dp_size)


@dataclass
class LoggingConfig:
    log_interval: int = 100
    tensorboard_dir: str | None = None
    tensorboard_log_interval: int = 1
    tensorboard_queue_size: int = 1000
    peak_tflops: float | None = None
    log_num_zeros_in_grad: bool = False


@dataclass
class PretrainConfig:
    model: GPTConfig
    parallel: ParallelConfig
    optimizer: OptimizerConfig
    data: DataConfig
    training: TrainingConfig
    logging: LoggingConfig
    tokenizer: object = field(default=None, repr=False, compare=False)

    @property
    def num_microbatches(self) -> int:
        return self.training.num_microbatches(self.parallel.data_parallel_size)

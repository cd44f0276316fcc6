"""The run's flags of ``pretrain_gpt.py`` (Megatron-LM's names): batches, iterations,
checkpoints, data and logging. ``flags.py`` declares the model's, the layout's and the
optimizer's, and builds the parser from both."""

from __future__ import annotations

import argparse

from megalite.checkpoint.formats import CKPT_FORMATS
from megalite.data.config import TOKENIZER_TYPES, DataConfig
from megalite.data.tiktoken_tokenizer import PATTERNS
from megalite.models.config import GPTConfig
from megalite.training.config import LoggingConfig, TrainingConfig
from megalite.training.flag_groups import FlagGroup


def training_flags(p: argparse.ArgumentParser) -> None:
    t = FlagGroup(p, "training", TrainingConfig, GPTConfig)
    t.add("--micro-batch-size", type=int, required=True)
    t.add("--global-batch-size", type=int, default=None, help="default: micro x data-parallel")
    t.add(
        "--rampup-batch-size",
        nargs=3,
        type=int,
        metavar=("START", "INCREMENT", "SAMPLES"),
        help="grow the global batch from START by INCREMENT over SAMPLES (--train-samples)",
    )
    t.add(
        "--step-batch-size-schedule",
        help='"0:B0 T1:B1 ...": batch Bi from Ti consumed tokens on (--train-samples)',
    )
    t.add("--train-iters", type=int, default=None)
    t.plain("--train-samples", type=int)
    for flag in ("--seed", "--eval-interval", "--eval-iters", "--exit-interval"):
        t.add(flag, type=int)
    t.add("--check-for-nan-in-loss-and-grad", action=argparse.BooleanOptionalAction)
    t.switch(
        "--calculate-per-token-loss",
        help="loss = token sum / unmasked tokens of the whole global batch",
    )
    t.switch("--exit-signal-handler", help="on --exit-signal: finish the iteration, save, exit 0")
    t.add("--exit-signal", help="the signal it catches (SIGTERM, SIGUSR1 ...)")
    t.add("--save", help="checkpoint directory to save to")
    t.add("--load", help="checkpoint directory to resume from (any TP/PP/DP layout)")
    t.add("--save-interval", type=int)
    t.add(
        "--ckpt-format",
        choices=CKPT_FORMATS,
        help="megalite's own files (default) or Megatron-LM's torch / torch_dist",
    )
    t.add("--ckpt-step", type=int, help="load this iteration instead of the latest")
    t.add(
        "--non-persistent-save-interval",
        type=int,
        help="also save every N iterations to --non-persistent-global-ckpt-dir (newest kept)",
    )
    t.add("--non-persistent-ckpt-type", choices=("global", "local", "in_memory"))
    t.add("--non-persistent-global-ckpt-dir", help="default: SAVE/non_persistent")
    t.switch(
        "--async-save",
        help="copy the checkpoint to host memory and write it in the background while training",
    )
    for flag in ("--no-save-optim", "--no-load-optim", "--no-load-rng"):
        t.switch(flag)
    t.switch("--finetune", help="load the weights only; iteration and data start at 0")
    t.switch(
        "--use-checkpoint-opt_param-scheduler",
        "--use-checkpoint-opt-param-scheduler",
        dest="use_checkpoint_opt_param_scheduler",
        help="the LR schedule (rates, warmup, decay length and style) from the checkpoint",
    )
    t.switch(
        "--deterministic-mode",
        help="torch's deterministic algorithms, NCCL_ALGO=Ring, CUBLAS_WORKSPACE_CONFIG=:4096:8",
    )
    t.add("--exit-duration-in-mins", type=float)
    t.add(
        "--keep-last-n-checkpoints",
        type=int,
        help="megalite's own: delete older iter_* folders after each save",
    )


def data_flags(p: argparse.ArgumentParser) -> None:
    d = FlagGroup(p, "data", DataConfig)
    for flag in ("--data-path", "--train-data-path", "--valid-data-path", "--test-data-path"):
        d.add(flag, nargs="*")
    d.plain("--data-args-path", default=None, help="a file holding the --data-path list")
    d.plain(
        "--per-split-data-args-path",
        default=None,
        help='a JSON file {"train": ..., "valid": ..., "test": ...} of data paths',
    )
    d.add("--split")
    d.add("--data-cache-path")
    d.switch("--mock-data")
    d.add("--tokenizer-type", help=f"one of {', '.join(TOKENIZER_TYPES)}")
    d.add("--tokenizer-model")
    d.add("--vocab-size", type=int)
    d.add("--vocab-file", help="GPT2BPETokenizer: vocab.json")
    d.add("--merge-file", help="GPT2BPETokenizer: merges.txt")
    d.add("--tiktoken-pattern", choices=sorted(PATTERNS))
    d.add("--tiktoken-num-special-tokens", type=int)
    d.add("--num-workers", type=int)
    d.switch("--eod-mask-loss")
    d.switch("--reset-position-ids", help="positions restart after each end-of-document")
    d.switch("--reset-attention-mask", help="attention does not cross an end-of-document")


def logging_flags(p: argparse.ArgumentParser) -> None:
    lg = FlagGroup(p, "logging", LoggingConfig)
    lg.add("--log-interval", type=int)
    lg.add("--tensorboard-dir")
    lg.add("--tensorboard-log-interval", type=int)
    lg.add("--tensorboard-queue-size", type=int)
    lg.add(
        "--peak-tflops",
        type=float,
        help="peak TFLOP/s of one device for MFU (default: GPU table)",
    )
    lg.switch("--log-num-zeros-in-grad")
    lg.switch("--log-straggler", help="name the ranks whose steps are slow, at the log interval")
    lg.add("--straggler-minmax-count", type=int, help="list this many slowest and fastest ranks")
    lg.add(
        "--straggler-slowdown",
        type=float,
        help="a rank is slow when its compute time per step exceeds this x the median",
    )
    lg.plain(
        "--log-throughput",
        action="store_true",
        help="accepted for Megatron scripts; throughput is always logged",
    )

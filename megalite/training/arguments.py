"""Megatron-LM's command-line flags -> a validated ``PretrainConfig``.

    cfg = with_tokenizer(parse_args(sys.argv[1:]))   # ConfigError (one line) on any bad input

``parse_args`` parses (``megalite.training.flags``), maps the flags onto the config dataclasses,
and calls their ``validate()`` before any process group exists: the world size comes from the
launcher's environment (``launch.detect_launch``) and is recorded in ``parallel.world_size``. The
dataclasses name their fields in errors; ``flag_message`` rewrites those names into flags here, so
a ``pretrain_gpt.py`` user reads ``--tensor-model-parallel-size``. An unknown flag is an error
("unknown flag --x"), never ignored; abbreviations are not accepted; a Megatron flag that megalite
does not implement says why (``megatron_flags.REFUSED_FLAGS``).

The tokenizer is not loaded here. With ``--tokenizer-type NullTokenizer`` the vocabulary is known
from ``--vocab-size`` and the tokenizer is set; otherwise ``with_tokenizer`` builds it from its
model file and fills ``model.vocab_size``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import os
import re
from collections.abc import Mapping, Sequence

import torch

from megalite.data.config import DataConfig
from megalite.errors import ConfigError
from megalite.models.config import PARAMS_DTYPES, VOCAB_FROM_TOKENIZER, GPTConfig
from megalite.training import megatron_flags, megatron_rewrites
from megalite.training.config import (
    LoggingConfig,
    PretrainConfig,
    TrainingConfig,
    with_tokenizer,
)
from megalite.training.flags import ATTENTION_BACKEND_ALIASES, build_parser
from megalite.training.launch import detect_launch
from megalite.training.megatron_flags import REFUSED_FLAGS
from megalite.training.optimizer_config import OptimizerConfig
from megalite.training.parallel_config import ParallelConfig
from megalite.training.signals import parse_signal

__all__ = ["build_config", "build_parser", "flag_message", "parse_args", "with_tokenizer"]

logger = logging.getLogger(__name__)

# Parameters of core/models functions that are not named like the field they take, as the flag
# that sets them (every other parameter is named after its field, which is the flag's dest).
_PARAMETER_FLAGS = {
    "tp_size": "--tensor-model-parallel-size",
    "pp_size": "--pipeline-model-parallel-size",
    "first_stage_layers": "--decoder-first-pipeline-num-layers",
    "last_stage_layers": "--decoder-last-pipeline-num-layers",
    "num_local_blocks": "--sparse-num-local-blocks",
    "num_global_blocks": "--sparse-num-global-blocks",
    "num_window_blocks": "--sparse-num-window-blocks",
    "num_random_blocks": "--sparse-num-random-blocks",
}
# Field names that are one plain word are rewritten only when they cannot be English.
_ONE_WORD_FIELDS = set(
    "lr fp16 bf16 seed save load finetune hysteresis device swiglu normalization".split()
)
_NAME = re.compile(r"(?<![\w\-./])[a-z][a-z0-9]*(?:_[a-z0-9]+)*(?![\w\-/])")


@functools.cache
def _field_flags() -> dict[str, str]:
    flags = {}
    for action in build_parser()._actions:
        longs = [o for o in action.option_strings if o.startswith("--")]
        if longs and action.dest not in flags:
            flags[action.dest] = longs[0]
    return {**flags, **_PARAMETER_FLAGS}


def flag_message(message: str) -> str:
    """``message`` with every config field / core parameter name it holds written as its flag:
    ``"num_layers 3 is not divisible by pp_size 2"`` -> ``"--num-layers 3 is not divisible by
    --pipeline-model-parallel-size 2"``. A name is rewritten when it is a whole word (not part of a
    path, a dotted name or a flag) and the dest of a flag; flags already there are left alone.
    ``parse_args`` applies it to every error of parsing and validation, ``pretrain_gpt.py`` to
    the errors of the run."""
    flags = _field_flags()

    def rewrite(m: re.Match) -> str:
        name = m.group(0)
        if name in flags and ("_" in name or name in _ONE_WORD_FIELDS):
            return flags[name]
        return name

    return _NAME.sub(rewrite, message)


def parse_args(
    argv: Sequence[str],
    env: Mapping[str, str] | None = None,
    *,
    parser: argparse.ArgumentParser | None = None,
) -> PretrainConfig:
    """Parse and validate; ``env`` (default ``os.environ``) gives the launcher's world size.
    Errors are ConfigErrors that name flags. ``parser``: one ``build_parser()`` reused (the
    planner validates thousands of layouts; building the parser is most of a parse)."""
    try:
        args, unknown = (parser or build_parser()).parse_known_args(list(argv))
        if unknown:
            _refuse_unknown(unknown)
        try:
            launch = detect_launch(env)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        cfg = build_config(args, world_size=launch.world_size, rank=launch.rank)
        load_after_restart(cfg, os.environ if env is None else env, rank=launch.rank)
        return cfg
    except ConfigError as e:
        raise ConfigError(flag_message(str(e))) from None


# set by the launchers to the number of times the job was restarted (torchrun --max-restarts,
# SLURM's requeue)
RESTART_COUNTS = ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")


def load_after_restart(cfg: PretrainConfig, env: Mapping[str, str], *, rank: int = 0) -> None:
    """A run the launcher restarted (a restart count above 0) with ``--save`` and no ``--load``
    resumes from ``--save``: its newest complete checkpoint (the tracker names only those), so no
    person has to add the flag. Logged in one line on ``rank`` 0."""
    t = cfg.training
    restarts = max(int(env.get(k, "0") or 0) for k in RESTART_COUNTS)
    if restarts and t.save and t.load is None:
        t.load = t.save
        if rank == 0:
            logger.warning("restart %d of this job: resuming from --save %s", restarts, t.save)


def _refuse_unknown(unknown: list[str]) -> None:
    flags = [u.split("=", 1)[0] for u in unknown if u.startswith("-") and not _is_number(u)]
    if not flags:
        raise ConfigError(f"unexpected argument(s) {' '.join(unknown)}")
    refused = [f for f in flags if f in REFUSED_FLAGS]
    if refused:
        raise ConfigError(
            f"unknown flag {refused[0]}: not implemented ({REFUSED_FLAGS[refused[0]]}); "
            "remove it to run"
        )
    raise ConfigError(
        f"unknown flag {flags[0]}"
        + (f" (also {', '.join(flags[1:])})" if flags[1:] else "")
        + "; see pretrain_gpt.py --help for the flags megalite implements"
    )


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _fields(cls: type, a: argparse.Namespace, **overrides) -> dict:
    """The flags named like ``cls``'s fields, then ``overrides``."""
    names = {f.name for f in dataclasses.fields(cls)}
    values = {n: getattr(a, n) for n in names if hasattr(a, n)}
    return {**values, **overrides}


def _batch_and_iters(a: argparse.Namespace, dp: int) -> tuple[int, int]:
    """(global_batch_size, train_iters): the batch defaults to micro x DP; --train-samples is
    counted in global batches."""
    gbs = a.global_batch_size
    if gbs is None:
        gbs = a.micro_batch_size * dp
    if (a.train_iters is None) == (a.train_samples is None):
        raise ConfigError("give exactly one of --train-iters and --train-samples")
    if a.train_samples is None:
        return gbs, a.train_iters
    if gbs < 1 or a.train_samples < gbs:
        raise ConfigError(
            f"--train-samples {a.train_samples} is less than one global batch ({gbs})"
        )
    return gbs, a.train_samples // gbs


def _model_flags(a: argparse.Namespace, *, rank: int) -> dict:
    """The model fields whose flags are not named like them (or need a check of their own)."""
    if a.num_query_groups is not None and not a.group_query_attention:
        raise ConfigError(
            "--num-query-groups needs --group-query-attention (or drop --num-query-groups)"
        )
    if a.group_query_attention and a.num_query_groups is None:
        raise ConfigError("--group-query-attention needs --num-query-groups N")
    granularity = a.recompute_granularity
    if a.recompute_activations:
        if granularity not in (None, "selective"):
            raise ConfigError(
                "--recompute-activations means selective; it conflicts with "
                f"--recompute-granularity {granularity}"
            )
        granularity = "selective"
    sequence_parallel = a.sequence_parallel
    if sequence_parallel and a.tensor_model_parallel_size == 1:
        if rank == 0:
            logger.warning(
                "--sequence-parallel has no effect with --tensor-model-parallel-size 1; off"
            )
        sequence_parallel = False
    if a.fp16 and a.bf16:
        raise ConfigError("--fp16 and --bf16 are mutually exclusive; choose one")
    return {
        "vocab_size": VOCAB_FROM_TOKENIZER,
        "add_bias_linear": not a.disable_bias_linear,
        "use_fused_kernels": not a.no_fused_kernels,
        "attention_backend": ATTENTION_BACKEND_ALIASES[a.attention_backend],
        "recompute_granularity": granularity,
        "sequence_parallel": sequence_parallel,
        "params_dtype": PARAMS_DTYPES["bf16" if a.bf16 else "fp16" if a.fp16 else "fp32"],
    }


def build_config(a: argparse.Namespace, *, world_size: int, rank: int = 0) -> PretrainConfig:
    """Map parsed flags onto a ``PretrainConfig`` for a ``world_size``-rank launch and validate it
    (warnings are logged on ``rank`` 0 only, once per job). Errors name fields (``parse_args``
    rewrites them into flags)."""
    megatron_rewrites.position_embedding_alias(a)
    megatron_flags.warn_ignored(a, rank=rank)
    megatron_rewrites.prepare(a)  # data-args files, the step batch schedule, ...
    if a.distributed_timeout_minutes is not None:  # given: a timeout to explain, too
        a.hang_watchdog = True
    else:
        a.distributed_timeout_minutes = ParallelConfig.distributed_timeout_minutes
    parallel = ParallelConfig(**_fields(ParallelConfig, a, world_size=world_size))
    if a.distributed_backend is not None:
        wanted = "cuda" if a.distributed_backend == "nccl" else "cpu"
        if a.device not in ("auto", wanted):
            raise ConfigError(
                f"--distributed-backend {a.distributed_backend} does not run on --device {a.device}"
            )
        parallel.device = wanted
        if wanted == "cuda" and not torch.cuda.is_available():
            raise ConfigError(
                "--distributed-backend nccl needs CUDA and this machine has no GPU "
                "(torch.cuda.is_available() is False); drop the flag to run on CPU with gloo"
            )
    parallel.validate()  # the world size first: the batch default below divides by DP
    gbs, train_iters = _batch_and_iters(a, parallel.data_parallel_size)
    try:
        exit_signal = parse_signal(a.exit_signal).name
    except ValueError as e:
        raise ConfigError(str(e)) from None
    try:
        model = GPTConfig(**_fields(GPTConfig, a, **_model_flags(a, rank=rank)))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    decay_iters = a.lr_decay_iters if a.lr_decay_iters is not None else train_iters
    cfg = PretrainConfig(
        model=model,
        parallel=parallel,
        optimizer=OptimizerConfig(**_fields(OptimizerConfig, a, lr_decay_iters=decay_iters)),
        data=DataConfig(**_fields(DataConfig, a)),
        training=TrainingConfig(
            **_fields(
                TrainingConfig,
                a,
                global_batch_size=gbs,
                train_iters=train_iters,
                exit_signal=exit_signal,
            )
        ),
        logging=LoggingConfig(**_fields(LoggingConfig, a)),
    )
    try:  # Megatron's sample-based LR schedule and batch-size schedules
        megatron_rewrites.apply_sample_schedule(cfg, a, train_samples=a.train_samples)
        megatron_rewrites.apply_batch_size_calculator(cfg, a)  # --rampup-batch-size: train_iters
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if rank == 0 and not a.fp16 and a.loss_scale is not None:
        logger.warning("--loss-scale applies to --fp16 only; it is ignored in this run")
    if cfg.data.tokenizer_type == "NullTokenizer":  # no file to load: the vocab is --vocab-size
        return with_tokenizer(cfg)
    cfg.validate()  # all but the vocabulary, which with_tokenizer fills from the model file
    return cfg

"""The Megatron-LM flags that rewrite others (``megatron_flags`` holds those that change nothing
and those refused).

Before the config is built (``prepare``), and on it (``apply_sample_schedule``,
``apply_batch_size_calculator``): ``--data-args-path`` / ``--per-split-data-args-path`` fill the
data paths from files (``data.config``); ``--step-batch-size-schedule`` sets the global batch size,
and it or ``--rampup-batch-size`` count the iterations of ``--train-samples``
(``training.microbatches``); ``--lr-warmup-samples`` / ``--lr-decay-samples`` become (fractional)
iterations (with ``--train-samples`` and no decay length the decay spans the samples, not whole
iterations, as Megatron's); ``--use-rotary-position-embeddings`` is Megatron's old alias of
``--position-embedding-type rope``; ``--account-for-embedding/loss-in-pipeline-split`` become the
first / last stage's layer counts; ``--moe-router-dtype fp32`` is megalite's router (fp64 is
refused); ``--override-opt_param-scheduler`` beside ``--use-checkpoint-opt_param-scheduler`` is
refused.
"""

from __future__ import annotations

import argparse

from megalite.data.config import read_data_args, read_per_split_data_args
from megalite.errors import ConfigError
from megalite.training.megatron_flags import ignored_given
from megalite.training.microbatches import batch_size_calculator, parse_step_schedule


def position_embedding_alias(a: argparse.Namespace) -> None:
    """``--use-rotary-position-embeddings``: Megatron's old spelling of RoPE."""
    if a.use_rotary_position_embeddings:
        a.position_embedding_type = "rope"


def apply_sample_schedule(cfg, a: argparse.Namespace, *, train_samples: int | None) -> None:
    """Megatron's sample-based LR schedule, in megalite's (fractional) iterations: warmup and
    decay lengths are ``samples / global_batch_size``; with ``--train-samples`` and no decay
    length the decay spans exactly the training samples."""
    gbs = cfg.training.global_batch_size
    opt = cfg.optimizer
    decay_samples = a.lr_decay_samples
    if decay_samples is None and train_samples is not None and a.lr_decay_iters is None:
        decay_samples = train_samples
    if decay_samples is not None:
        if a.lr_decay_iters is not None:
            raise ValueError("give one of --lr-decay-iters and --lr-decay-samples")
        opt.lr_decay_iters = decay_samples / gbs
    if a.lr_warmup_samples is not None:
        if a.lr_warmup_iters or a.lr_warmup_fraction is not None:
            raise ValueError(
                "give one of --lr-warmup-samples, --lr-warmup-iters and --lr-warmup-fraction"
            )
        opt.lr_warmup_iters = a.lr_warmup_samples / gbs


def apply_data_args(a: argparse.Namespace) -> None:
    """``--data-args-path`` / ``--per-split-data-args-path``: the blend lists read from files
    (``data.config.read_data_args``) into ``--data-path`` / ``--{train,valid,test}-data-path``."""
    try:
        if a.data_args_path is not None:
            if a.data_path:
                raise ConfigError("--data-args-path and --data-path are mutually exclusive")
            a.data_path = read_data_args(a.data_args_path)
        if a.per_split_data_args_path is not None:
            if a.train_data_path or a.valid_data_path or a.test_data_path:
                raise ConfigError(
                    "--per-split-data-args-path and --train/valid/test-data-path are mutually "
                    "exclusive"
                )
            a.train_data_path, a.valid_data_path, a.test_data_path = read_per_split_data_args(
                a.per_split_data_args_path
            )
    except ValueError as e:
        raise ConfigError(str(e)) from None


def step_schedule_batch(a: argparse.Namespace) -> None:
    """``--step-batch-size-schedule``: its last batch is the global batch size. Megatron refuses
    ``--global-batch-size`` beside it (its own GPT-3 example passes both, equal): megalite
    accepts the same value and refuses another."""
    if a.step_batch_size_schedule is None:
        return
    steps = parse_step_schedule(a.step_batch_size_schedule, seq_length=a.seq_length)
    final = steps[-1][1]
    if a.global_batch_size is not None and a.global_batch_size != final:
        raise ConfigError(
            f"--global-batch-size {a.global_batch_size} differs from the last batch size {final} "
            f"of --step-batch-size-schedule; drop --global-batch-size (the schedule sets it)"
        )
    a.global_batch_size = final


def apply_batch_size_calculator(cfg, a: argparse.Namespace) -> None:
    """A batch-size ramp or step schedule: every batch size checked against micro x DP;
    ``train_iters`` counted as Megatron counts them from ``--train-samples``. A ramp needs
    sample-based training (as Megatron); a step schedule may run ``--train-iters`` (its LR
    schedule then spans ``--lr-decay-iters`` x the final batch in samples, as Megatron's)."""
    t = cfg.training
    if t.rampup_batch_size is None and t.step_batch_size_schedule is None:
        return
    if t.rampup_batch_size is not None and a.train_samples is None:
        raise ConfigError(
            "--rampup-batch-size needs sample-based training: give --train-samples N instead of "
            "--train-iters (and --lr-decay-samples / --lr-warmup-samples for the schedule)"
        )
    schedule = batch_size_calculator(
        t, cfg.parallel.data_parallel_size, seq_length=cfg.model.seq_length
    )
    if a.train_samples is not None:
        t.train_iters = schedule.train_iters(a.train_samples)
        if t.train_iters < 1:
            raise ConfigError(f"--train-samples {a.train_samples} holds no iteration")


def scheduler_source(a: argparse.Namespace) -> None:
    """``--override-opt_param-scheduler`` (the flags' schedule, megalite's default) and
    ``--use-checkpoint-opt_param-scheduler`` (the checkpoint's) contradict, as in Megatron."""
    given = ignored_given(a)
    override = any(
        f in given for f in ("--override-opt_param-scheduler", "--override-opt-param-scheduler")
    )
    if override and a.use_checkpoint_opt_param_scheduler:
        raise ConfigError(
            "--override-opt_param-scheduler (the flags' LR schedule) and "
            "--use-checkpoint-opt_param-scheduler (the checkpoint's) contradict each other; "
            "keep one"
        )


def router_dtype(a: argparse.Namespace) -> None:
    """``--moe-router-dtype``: megalite's router math is fp32 always (what fp32 asks for)."""
    if a.moe_router_dtype not in (None, "fp32"):
        raise ConfigError(
            f"--moe-router-dtype {a.moe_router_dtype} is not implemented: megalite's router "
            "computes in fp32 (--moe-router-dtype fp32, or leave it out)"
        )


def pipeline_split_accounting(a: argparse.Namespace) -> None:
    """``--account-for-embedding-in-pipeline-split`` / ``--account-for-loss-in-pipeline-split``:
    the embedding (first stage) and the loss (last stage) count as one layer each, so
    num_layers + their count is split evenly over the PP stages and those stages hold one layer
    fewer; megalite's uneven split (``--decoder-first/last-pipeline-num-layers``) says so."""
    extra = {"first": a.account_for_embedding_in_pipeline_split}
    extra["last"] = a.account_for_loss_in_pipeline_split
    pp = a.pipeline_model_parallel_size
    if not any(extra.values()) or pp == 1:
        return
    flags = " / ".join(
        f"--account-for-{w}-in-pipeline-split"
        for w, on in (("embedding", extra["first"]), ("loss", extra["last"]))
        if on
    )
    if a.decoder_first_pipeline_num_layers is not None or (
        a.decoder_last_pipeline_num_layers is not None
    ):
        raise ConfigError(
            f"{flags} and --decoder-first/last-pipeline-num-layers both set the split; keep one"
        )
    if a.num_layers_per_virtual_pipeline_stage or a.num_virtual_stages_per_pipeline_rank:
        raise ConfigError(
            f"{flags} with virtual pipeline stages is not implemented; drop one of them"
        )
    total = a.num_layers + sum(extra.values())
    if total % pp:
        raise ConfigError(
            f"{flags}: --num-layers {a.num_layers} + {sum(extra.values())} = {total} is not "
            f"divisible by --pipeline-model-parallel-size {pp}"
        )
    per_stage = total // pp
    if extra["first"]:
        a.decoder_first_pipeline_num_layers = per_stage - 1
    if extra["last"]:
        a.decoder_last_pipeline_num_layers = per_stage - 1


def prepare(a: argparse.Namespace) -> None:
    """The Megatron flags that rewrite others before the config is built (module docstring)."""
    apply_data_args(a)
    step_schedule_batch(a)
    scheduler_source(a)
    router_dtype(a)
    pipeline_split_accounting(a)
    if a.decoupled_min_lr is not None and a.decoupled_lr is None:
        raise ConfigError("--decoupled-min-lr needs --decoupled-lr (the rate it decays from)")

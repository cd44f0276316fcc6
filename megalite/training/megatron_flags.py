"""Megatron-LM flags that change nothing in megalite, the flags it refuses, and the Megatron flags
that rewrite others before the config is built.

A Megatron user's script runs unchanged (DESIGN §6): a flag that only switches an implementation,
a fusion, an I/O strategy or a log Megatron writes elsewhere (``IGNORED_FLAGS``) is accepted, and
one warning line lists those a run passed and why nothing changes; a flag that would change the
math and that megalite does not implement is refused (``REFUSED_FLAGS``), one line naming the flag
and why. None is silently ignored.

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
import logging

from megalite.data.config import read_data_args, read_per_split_data_args
from megalite.errors import ConfigError
from megalite.training.microbatches import batch_size_calculator, parse_step_schedule

logger = logging.getLogger(__name__)

_FUSION = "a kernel-fusion switch: megalite picks its Triton kernels or their PyTorch reference"
_TE = "an implementation switch: megalite has one implementation (no Transformer Engine)"
_CKPT_IO = "a Megatron checkpoint I/O strategy: megalite writes each file synchronously"
_LOG = "a Megatron log toggle: megalite logs its own fixed set of progress lines"
_PERF = "a performance knob of Megatron's kernels or overlap: the numbers do not change"
_PROFILE = (
    "Megatron's profiler window: megalite writes no trace (wrap pretrain in torch.profiler); "
    "the numbers do not change"
)
_CKPT_ARGS = "megalite checks the model flags against the checkpoint's and stops on any difference"
_SCHEDULE = (
    "megalite's default: the LR schedule comes from the flags (a warning names the "
    "checkpoint's settings that differ); --use-checkpoint-opt_param-scheduler takes the "
    "checkpoint's"
)

# flag -> why nothing changes in megalite. Values: flags in VALUED_FLAGS take one value.
IGNORED_FLAGS: dict[str, str] = {
    "--transformer-impl": _TE,
    "--use-mcore-models": _TE,
    "--use-legacy-models": _TE,
    "--no-gradient-accumulation-fusion": _FUSION,
    "--gradient-accumulation-fusion": _FUSION,
    "--no-bias-gelu-fusion": _FUSION,
    "--no-bias-swiglu-fusion": _FUSION,
    "--no-bias-dropout-fusion": _FUSION,
    "--no-rope-fusion": _FUSION,
    "--cross-entropy-loss-fusion": _FUSION,
    "--cross-entropy-fusion-impl": _FUSION,
    "--use-flashinfer-fused-rope": _FUSION,
    "--no-async-tensor-model-parallel-allreduce": _PERF,
    "--tp-comm-overlap": _PERF,
    "--tp-comm-overlap-cfg": _PERF,
    "--overlap-param-gather-with-optimizer-step": _PERF,
    "--disable-gloo-process-groups": "megalite creates no gloo process groups beside NCCL's",
    "--overlap-p2p-communication-warmup-flush": _PERF,
    "--defer-embedding-wgrad-compute": _PERF,
    "--wgrad-deferral-limit": _PERF,
    "--enable-cuda-graph": _PERF,
    "--cuda-graph-impl": _PERF,
    "--empty-unused-memory-level": _PERF,
    "--manual-gc": "Python garbage-collection timing: no effect on the numbers",
    "--manual-gc-interval": "Python garbage-collection timing: no effect on the numbers",
    "--ddp-average-in-collective": "megalite divides the summed gradient by DP itself: the "
    "same average",
    "--num-distributed-optimizer-instances": "how Megatron groups its optimizer shards: the "
    "same update",
    "--attention-softmax-in-fp32": "megalite's softmax statistics are always fp32",
    "--apply-query-key-layer-scaling": "an fp16 overflow guard that scales and unscales by the "
    "layer number: the same function",
    "--no-create-attention-mask-in-dataloader": "megalite's attention is causal without a "
    "dataloader mask",
    "--no-mmap-bin-files": "how .bin files are read: the same tokens",
    "--async-save": _CKPT_IO,
    "--use-persistent-ckpt-worker": _CKPT_IO,
    "--ckpt-fully-parallel-save": _CKPT_IO,
    "--no-ckpt-fully-parallel-save": _CKPT_IO,
    "--ckpt-fully-parallel-load": _CKPT_IO,
    "--ckpt-assume-constant-structure": _CKPT_IO,
    "--async-strategy": _CKPT_IO,
    "--dist-ckpt-strictness": _CKPT_IO,
    "--dist-ckpt-optim-fully-reshardable": "megalite reads and writes Megatron's optimizer "
    "state in model space, reshardable at any layout",
    "--auto-detect-ckpt-format": "megalite always detects the format it loads",
    "--use-checkpoint-args": _CKPT_ARGS,
    "--no-use-tokenizer-model-from-checkpoint-args": "the tokenizer always comes from the flags",
    "--override-opt_param-scheduler": _SCHEDULE,
    "--override-opt-param-scheduler": _SCHEDULE,
    "--async-ckpt-use-cpu-shm": _CKPT_IO,
    "--save-retain-interval": "which old checkpoints Megatron deletes (megalite: "
    "--keep-last-n-checkpoints)",
    "--check-weight-hash-across-dp-replicas-interval": "a Megatron consistency check",
    "--rerun-mode": "Megatron's fault re-run machine",
    "--verify-integrity": "a Megatron consistency check",
    "--log-timers-to-tensorboard": _LOG,
    "--log-memory-to-tensorboard": _LOG,
    "--log-validation-ppl-to-tensorboard": _LOG,
    "--log-params-norm": _LOG,
    "--log-progress": _LOG,
    "--log-straggler": _LOG,
    "--straggler-minmax-count": _LOG,
    "--timing-log-level": _LOG,
    "--timing-log-option": _LOG,
    "--log-loss-scale-to-tensorboard": _LOG,
    "--log-world-size-to-tensorboard": _LOG,
    "--wandb-project": _LOG + " (Weights & Biases is not wired: use --tensorboard-dir)",
    "--wandb-entity": _LOG,
    "--wandb-exp-name": _LOG,
    "--wandb-save-dir": _LOG,
    "--test-mode": "Megatron's functional-test switch",
    "--profile": _PROFILE,
    "--profile-step-start": _PROFILE,
    "--profile-step-end": _PROFILE,
}
VALUED_FLAGS = {
    "--tp-comm-overlap-cfg",
    "--transformer-impl",
    "--cross-entropy-fusion-impl",
    "--wgrad-deferral-limit",
    "--cuda-graph-impl",
    "--empty-unused-memory-level",
    "--manual-gc-interval",
    "--num-distributed-optimizer-instances",
    "--async-strategy",
    "--dist-ckpt-strictness",
    "--save-retain-interval",
    "--check-weight-hash-across-dp-replicas-interval",
    "--rerun-mode",
    "--straggler-minmax-count",
    "--timing-log-level",
    "--timing-log-option",
    "--wandb-project",
    "--wandb-entity",
    "--wandb-exp-name",
    "--wandb-save-dir",
    "--profile-step-start",
    "--profile-step-end",
}

_FP8 = "FP8 training needs Transformer Engine"
_ATTENTION = "an attention variant: multi-latent, gated, linear or sparse attention"
_FSDP = (
    "Megatron's or PyTorch's FSDP: megalite's fully sharded rung is --zero-stage 3 "
    "(--data-parallel-sharding-strategy optim_grads_params)"
)
_FIM = "fill-in-the-middle data: megalite's GPT dataset has no FIM transform"
_DISTILL = "ModelOpt export and knowledge distillation"
# Megatron flags that change the math and that megalite does not implement: flag -> why.
REFUSED_FLAGS: dict[str, str] = {
    "--rotary-scaling-factor": "YaRN rotary scaling, used with multi-latent attention",
    "--fp8-format": _FP8,
    "--fp8-recipe": _FP8,
    "--fp8-param-gather": _FP8,
    "--first-last-layers-bf16": _FP8,
    "--multi-latent-attention": _ATTENTION,
    "--q-lora-rank": _ATTENTION,
    "--kv-lora-rank": _ATTENTION,
    "--qk-head-dim": _ATTENTION,
    "--qk-pos-emb-head-dim": _ATTENTION,
    "--v-head-dim": _ATTENTION,
    "--experimental-attention-variant": _ATTENTION,
    "--attention-output-gate": _ATTENTION,
    "--fp8-amax-history-len": _FP8,
    "--fp8-amax-compute-algo": _FP8,
    "--linear-attention-freq": _ATTENTION,
    "--linear-conv-kernel-dim": _ATTENTION,
    "--linear-key-head-dim": _ATTENTION,
    "--linear-value-head-dim": _ATTENTION,
    "--linear-num-key-heads": _ATTENTION,
    "--linear-num-value-heads": _ATTENTION,
    "--dsa-indexer-n-heads": _ATTENTION,
    "--dsa-indexer-head-dim": _ATTENTION,
    "--dsa-indexer-topk": _ATTENTION,
    "--dsa-indexer-loss-coeff": _ATTENTION,
    "--use-torch-fsdp2": _FSDP,
    "--use-megatron-fsdp": _FSDP,
    "--megatron-fsdp-main-params-dtype": _FSDP,
    "--megatron-fsdp-main-grads-dtype": _FSDP,
    "--megatron-fsdp-grad-comm-dtype": _FSDP,
    "--fim-data": _FIM,
    "--fim-rate": _FIM,
    "--fim-spm-rate": _FIM,
    "--export-te-mcore-model": _DISTILL,
    "--export-kd-teacher-load": _DISTILL,
    "--export-kd-cfg": _DISTILL,
    "--use-mup": "maximal-update parametrization (muP) scales init and learning rates",
    "--mup-base-hidden-size": "maximal-update parametrization (muP) scales init and learning rates",
    "--error-injection-rate": "Megatron's fault injection into its re-run machine",
    "--error-injection-type": "Megatron's fault injection into its re-run machine",
    "--eval-global-batch-size": "evaluation runs at --global-batch-size",
    "--hierarchical-context-parallel-sizes": "context parallelism is one cp group (a2a+p2p "
    "hierarchies are not built)",
    "--apply-wd-to-qk-layernorm": "weight decay on the q/k layer norms: megalite never "
    "decays a norm or a bias",
}


def _ignored_dest(flag: str) -> str:
    return "ignored_" + flag[2:].replace("-", "_")


def add_ignored_flags(parser: argparse.ArgumentParser) -> None:
    """``IGNORED_FLAGS``, accepted and hidden from ``--help`` (``warn_ignored`` names them)."""
    g = parser.add_argument_group("Megatron-LM flags that change nothing in megalite")
    for flag in IGNORED_FLAGS:
        if flag in VALUED_FLAGS:
            g.add_argument(flag, dest=_ignored_dest(flag), default=None, help=argparse.SUPPRESS)
        else:
            g.add_argument(
                flag, dest=_ignored_dest(flag), action="store_true", help=argparse.SUPPRESS
            )


def ignored_given(a: argparse.Namespace) -> list[str]:
    """The ignored flags this command line passed."""
    return [f for f in IGNORED_FLAGS if getattr(a, _ignored_dest(f)) not in (None, False)]


def warn_ignored(a: argparse.Namespace, *, rank: int) -> None:
    given = ignored_given(a)
    if given and rank == 0:
        reasons: dict[str, list[str]] = {}
        for f in given:
            reasons.setdefault(IGNORED_FLAGS[f], []).append(f)
        logger.warning(
            "ignored %d Megatron flag(s) that change nothing in megalite: %s",
            len(given),
            "; ".join(f"{' '.join(fs)} ({why})" for why, fs in reasons.items()),
        )


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
    override = any(
        getattr(a, _ignored_dest(f))
        for f in ("--override-opt_param-scheduler", "--override-opt-param-scheduler")
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

"""Megatron-LM flags that change nothing in megalite, and the flags it refuses.

A Megatron user's script runs unchanged (DESIGN §6): a flag that only switches an implementation,
a fusion, an I/O strategy or a log Megatron writes elsewhere (``IGNORED_FLAGS``) is accepted, and
one warning line lists those a run passed and why nothing changes; a flag that would change the
math and that megalite does not implement is refused (``REFUSED_FLAGS``), one line naming the flag
and why. None is silently ignored. The Megatron flags that rewrite others are
``megatron_rewrites``'.
"""

from __future__ import annotations

import argparse
import logging

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
    "--disable-straggler-on-startup": "megalite's --log-straggler has no runtime switch",
    "--straggler-ctrlr-port": "megalite's --log-straggler has no runtime switch",
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
    "--straggler-ctrlr-port",
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
_MUP = "maximal-update parametrization (muP) scales init and learning rates"
_INJECT = "Megatron's fault injection into its re-run machine"
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
    "--use-mup": _MUP,
    "--mup-base-hidden-size": _MUP,
    "--error-injection-rate": _INJECT,
    "--error-injection-type": _INJECT,
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

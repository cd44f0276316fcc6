"""The ``pretrain_gpt.py`` command line: Megatron-LM's flag names, parsed by argparse.

Only parsing lives here: ``megalite.training.arguments`` maps the parsed flags onto the config
dataclasses, which validate themselves. Each flag's default is read from the dataclass field it
fills (``--lr-warmup-iters`` -> ``OptimizerConfig.lr_warmup_iters``), so it is written once.
"""

from __future__ import annotations

import argparse
import dataclasses

from megalite.core.moe.config import (
    DISPATCHERS,
    DROP_POLICIES,
    LOAD_BALANCING_TYPES,
    SCORE_FUNCTIONS,
)
from megalite.data.config import DataConfig
from megalite.models.config import (
    ATTENTION_BACKENDS,
    NORMALIZATIONS,
    POSITION_EMBEDDING_TYPES,
    GPTConfig,
)
from megalite.training.config import (
    DEVICES,
    PIPELINE_SCHEDULES,
    SHARDING_STRATEGIES,
    ConfigError,
    LoggingConfig,
    OptimizerConfig,
    ParallelConfig,
    TrainingConfig,
)
from megalite.training.lr_scheduler import DECAY_STYLES
from megalite.training.megatron_flags import REFUSED_FLAGS, add_megatron_flags

# Megatron's --attention-backend values map onto the two megalite implements.
ATTENTION_BACKEND_ALIASES = {
    "sdpa": "sdpa", "unfused": "unfused", "auto": "sdpa", "flash": "sdpa", "fused": "sdpa",
    "local": "unfused",
}  # fmt: skip

# Megatron flags that an open issue brings; until then they are refused as unknown, saying which.
PLANNED_FLAGS = {
    **REFUSED_FLAGS,  # issue 18: megatron_flags.py
}  # fmt: skip


def _int_or_list(text: str) -> int | str:
    """``--moe-layer-freq``: an integer, or a list expression kept as text (checked later)."""
    return int(text) if text.strip().isdigit() else text


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would print usage and exit; we raise one line
        if message.startswith("the following arguments are required"):
            message = "missing required flag(s): " + message.split(": ", 1)[1]
        raise ConfigError(message)


def _default(cls: type, name: str):
    for f in dataclasses.fields(cls):
        if f.name == name:
            if f.default is dataclasses.MISSING:
                raise TypeError(f"{cls.__name__}.{name} has no default")
            return f.default
    raise TypeError(f"{cls.__name__} has no field {name}")


class _Group:
    """An argument group whose options take their default from one dataclass."""

    def __init__(self, parser: argparse.ArgumentParser, title: str, source: type):
        self.group, self.source = parser.add_argument_group(title), source

    def add(self, flag: str, **kwargs) -> None:
        """A valued flag; its default is the field of the same name (``--a-b`` -> ``a_b``)."""
        name = kwargs.get("dest", flag[2:].replace("-", "_"))
        if not kwargs.get("required"):
            kwargs.setdefault("default", _default(self.source, name))
        self.group.add_argument(flag, **kwargs)

    def switch(self, flag: str, **kwargs) -> None:
        """An on/off flag for a field whose default is False."""
        name = kwargs.get("dest", flag[2:].replace("-", "_"))
        if _default(self.source, name) is not False:
            raise TypeError(f"{flag}: {self.source.__name__}.{name} must default to False")
        self.group.add_argument(flag, action="store_true", **kwargs)

    def plain(self, *args, **kwargs) -> None:
        """A flag with no field of its own (mapped or checked in ``arguments``)."""
        self.group.add_argument(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="pretrain_gpt.py",
        allow_abbrev=False,
        description="Megatron-LM's command-line flags -> a validated PretrainConfig.",
    )
    m = _Group(p, "model", GPTConfig)
    for flag in ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length"):
        m.add(flag, type=int, required=True)
    for flag in ("--ffn-hidden-size", "--kv-channels", "--num-query-groups"):
        m.add(flag, type=int)
    m.plain("--group-query-attention", action="store_true")
    m.add("--max-position-embeddings", type=int)
    m.add("--position-embedding-type", choices=POSITION_EMBEDDING_TYPES)
    m.add("--rotary-base", type=int)
    m.add("--normalization", choices=NORMALIZATIONS)
    m.add("--norm-epsilon", type=float)
    m.switch("--swiglu")
    m.switch("--openai-gelu")
    m.plain("--disable-bias-linear", action="store_true")
    m.switch("--untie-embeddings-and-output-weights")
    for flag in ("--hidden-dropout", "--attention-dropout", "--init-method-std"):
        m.add(flag, type=float)
    m.add("--make-vocab-size-divisible-by", type=int)
    m.add("--label-smoothing", type=float)
    assert set(ATTENTION_BACKENDS) <= set(ATTENTION_BACKEND_ALIASES)
    m.add("--attention-backend", choices=sorted(ATTENTION_BACKEND_ALIASES))
    m.add("--recompute-granularity", choices=["full", "selective"])
    m.plain("--recompute-activations", action="store_true",
            help="Megatron's alias of --recompute-granularity selective")  # fmt: skip
    m.add("--recompute-method", choices=["uniform", "block"])
    m.add("--recompute-num-layers", type=int)
    for flag in ("--no-fused-kernels", "--no-masked-softmax-fusion", "--no-persist-layer-norm"):
        m.plain(flag, dest="no_fused_kernels", action="store_true",
                help="use the PyTorch reference instead of the Triton kernels")  # fmt: skip
    m.add("--decoder-first-pipeline-num-layers", type=int)
    m.add("--decoder-last-pipeline-num-layers", type=int)
    # issue 18: Megatron's math flags (--rotary-percent is in megatron_flags' group)
    m.switch("--apply-layernorm-1p", help="norm weights stored as w - 1, applied as 1 + w")
    m.switch("--qk-layernorm", help="a norm over each head's query and key")
    m.switch("--squared-relu", help="relu(x)^2 instead of GELU in the MLP")
    m.switch("--rotary-interleaved", help="RoPE pairs channels (2i, 2i+1)")
    m.switch("--use-rope-scaling", help="Llama 3.1 RoPE frequency scaling")
    m.add("--rope-scaling-factor", type=float, help="Llama 3.1 RoPE scaling factor (8)")
    t18 = _Group(p, "loss and documents (issue 18)", TrainingConfig)
    t18.switch("--calculate-per-token-loss",
               help="loss = token sum / unmasked tokens of the whole global batch")  # fmt: skip
    d18 = _Group(p, "documents in a sample (issue 18)", DataConfig)
    d18.switch("--reset-position-ids", help="positions restart after each end-of-document")
    d18.switch("--reset-attention-mask", help="attention does not cross an end-of-document")

    par = _Group(p, "parallelism", ParallelConfig)
    par.add("--tensor-model-parallel-size", type=int)
    par.add("--pipeline-model-parallel-size", type=int)
    par.add("--pipeline-schedule", choices=PIPELINE_SCHEDULES)
    for flag in ("--sequence-parallel", "--use-distributed-optimizer", "--overlap-grad-reduce",
                 "--overlap-param-gather", "--accumulate-allreduce-grads-in-fp32"):  # fmt: skip
        par.switch(flag)
    par.switch("--use-tp-pp-dp-mapping",
               help="rank order tp-cp-ep-pp-dp: DP the slowest axis instead of PP")  # fmt: skip
    # issue 14: virtual pipeline stages
    par.add("--num-layers-per-virtual-pipeline-stage", type=int)
    par.add("--num-virtual-stages-per-pipeline-rank", type=int)
    par.add("--microbatch-group-size-per-virtual-pipeline-stage", type=int)
    par.switch("--no-overlap-p2p-communication",
               help="wait for each stage-to-stage receive where it is posted")  # fmt: skip
    par.add("--ddp-bucket-size", type=int)
    # issue 18: Megatron's bucket count (bucket size = this rank's parameters // N)
    par.add("--ddp-num-buckets", type=int)
    par.add("--distributed-timeout-minutes", type=float)
    par.plain("--distributed-backend", choices=["nccl", "gloo"])
    par.add("--device", choices=DEVICES)

    cp = _Group(p, "context parallel", ParallelConfig)  # issue 15
    cp.add("--context-parallel-size", type=int,
           help="split each sequence over N ranks (2 x N load-balanced chunks)")  # fmt: skip
    cp.add("--cp-comm-type", choices=["p2p", "a2a", "all_gather"],
           help="p2p: K/V ring; a2a: Ulysses all-to-all; all_gather: K/V gathered")  # fmt: skip
    z = _Group(p, "ZeRO ladder and optimizer offload (issue 13)", ParallelConfig)
    z.add("--data-parallel-sharding-strategy", choices=list(SHARDING_STRATEGIES),
          help="no_shard (DDP), optim (ZeRO-1), optim_grads (ZeRO-2), optim_grads_params "
               "(ZeRO-3)")  # fmt: skip
    z.add("--zero-stage", type=int, choices=[0, 1, 2, 3],
          help="DeepSpeed's alias of --data-parallel-sharding-strategy")  # fmt: skip
    z.switch("--optimizer-cpu-offload", help="fp32 masters, Adam moments and the step on the host")
    z.add("--optimizer-offload-fraction", type=float,
          help="share of the optimizer state (and step) offloaded, in [0, 1]")  # fmt: skip
    z.add("--optimizer-offload-dir",
          help="NVMe offload: the offloaded optimizer state in files under DIR")  # fmt: skip
    z.add("--optimizer-offload-host-memory-mb", type=float,
          help="bound on the host buffers that stream the NVMe state (MiB)")  # fmt: skip

    o = _Group(p, "optimizer", OptimizerConfig)
    o.plain("--optimizer", default="adam", choices=["adam"])
    o.add("--lr", type=float, required=True)
    o.add("--min-lr", type=float)
    o.add("--lr-decay-style", choices=DECAY_STYLES)
    o.add("--lr-decay-iters", type=int)
    o.add("--lr-warmup-iters", type=int)
    for flag in ("--lr-warmup-fraction", "--lr-warmup-init", "--weight-decay", "--clip-grad",
                 "--adam-beta1", "--adam-beta2", "--adam-eps", "--loss-scale",
                 "--initial-loss-scale", "--min-loss-scale"):  # fmt: skip
        o.add(flag, type=float)
    o.switch("--bf16")
    o.switch("--fp16")
    o.add("--loss-scale-window", type=int)
    o.add("--hysteresis", type=int)

    t = _Group(p, "training", TrainingConfig)
    t.add("--micro-batch-size", type=int, required=True)
    t.add("--global-batch-size", type=int, default=None, help="default: micro x data-parallel")
    t.add("--train-iters", type=int, default=None)
    t.plain("--train-samples", type=int)
    for flag in ("--seed", "--eval-interval", "--eval-iters", "--exit-interval"):
        t.add(flag, type=int)
    t.add("--check-for-nan-in-loss-and-grad", action=argparse.BooleanOptionalAction)
    t.switch("--exit-signal-handler", help="on --exit-signal: finish the iteration, save, exit 0")
    t.add("--exit-signal", help="the signal it catches (SIGTERM, SIGUSR1 ...)")
    t.add("--save", help="checkpoint directory to save to")
    t.add("--load", help="checkpoint directory to resume from (any TP/PP/DP layout)")
    t.add("--save-interval", type=int)
    t.add("--ckpt-step", type=int, help="load this iteration instead of the latest")
    for flag in ("--no-save-optim", "--no-load-optim", "--no-load-rng"):
        t.switch(flag)
    t.switch("--finetune", help="load the weights only; iteration and data start at 0")
    t.add("--exit-duration-in-mins", type=float)
    t.add("--keep-last-n-checkpoints", type=int,
          help="megalite's own: delete older iter_* folders after each save")  # fmt: skip

    # issue 16: mixture of experts and expert parallelism
    moe = _Group(p, "mixture of experts", GPTConfig)
    for flag in ("--num-experts", "--moe-ffn-hidden-size", "--moe-router-topk",
                 "--moe-shared-expert-intermediate-size"):  # fmt: skip
        moe.add(flag, type=int)
    moe.add("--moe-router-score-function", choices=SCORE_FUNCTIONS)
    moe.add("--moe-router-load-balancing-type", choices=LOAD_BALANCING_TYPES)
    for flag in ("--moe-aux-loss-coeff", "--moe-z-loss-coeff", "--moe-router-bias-update-rate",
                 "--moe-expert-capacity-factor"):  # fmt: skip
        moe.add(flag, type=float)
    moe.add("--moe-token-drop-policy", choices=DROP_POLICIES)
    moe.add("--moe-token-dispatcher-type", choices=DISPATCHERS)
    moe.add("--moe-layer-freq", type=_int_or_list, help="N (every N-th layer) or [1,0,1,0]")
    for flag in ("--moe-router-pre-softmax", "--moe-router-enable-expert-bias",
                 "--moe-pad-expert-input-to-capacity", "--moe-grouped-gemm",
                 "--moe-shared-expert-gate"):  # fmt: skip
        moe.switch(flag)
    moe.switch("--add-qkv-bias", help="a bias on the QKV projection only (Qwen2, Qwen2-MoE)")
    ep = _Group(p, "expert parallelism", ParallelConfig)
    ep.add("--expert-model-parallel-size", type=int)
    ep.add("--expert-tensor-parallel-size", type=int)

    d = _Group(p, "data", DataConfig)
    for flag in ("--data-path", "--train-data-path", "--valid-data-path", "--test-data-path"):
        d.add(flag, nargs="*")
    d.add("--split")
    d.add("--data-cache-path")
    d.switch("--mock-data")
    d.add("--tokenizer-type")
    d.add("--tokenizer-model")
    d.add("--vocab-size", type=int)
    d.add("--vocab-file", help="GPT2BPETokenizer: vocab.json")
    d.add("--merge-file", help="GPT2BPETokenizer: merges.txt")
    d.add("--tiktoken-pattern", choices=["v1", "v2"])
    d.add("--tiktoken-num-special-tokens", type=int)
    d.add("--num-workers", type=int)
    d.switch("--eod-mask-loss")

    lg = _Group(p, "logging", LoggingConfig)
    lg.add("--log-interval", type=int)
    lg.add("--tensorboard-dir")
    lg.add("--tensorboard-log-interval", type=int)
    lg.add("--tensorboard-queue-size", type=int)
    lg.add("--peak-tflops", type=float,
           help="peak TFLOP/s of one device for MFU (default: GPU table)")  # fmt: skip
    lg.switch("--log-num-zeros-in-grad")
    lg.plain("--log-throughput", action="store_true",
             help="accepted for Megatron scripts; throughput is always logged")  # fmt: skip
    add_megatron_flags(p, _Group(p, "Megatron migration (issue 18)", TrainingConfig))
    return p

"""The ``pretrain_gpt.py`` command line: Megatron-LM's flag names, parsed by argparse.

Only parsing lives here, with the run's flags in ``run_flags`` and the machinery in
``flag_groups``: ``megalite.training.arguments`` maps the parsed flags onto the config
dataclasses, which validate themselves. Each flag's default is read from the dataclass field it
fills (``--lr-warmup-iters`` -> ``OptimizerConfig.lr_warmup_iters``), so it is written once; so are
the choices of a flag, from the module that implements them (``--pipeline-schedule`` ->
``core.pipeline_parallel.generators.SCHEDULES``). Megatron's flags that change nothing in megalite
are accepted with one warning (``megatron_flags``).
"""

from __future__ import annotations

import argparse

from megalite.core.attention.sparse_layouts import SPARSE_LAYOUTS
from megalite.core.context_parallel import CP_COMM_TYPES
from megalite.core.distributed import STRATEGIES
from megalite.core.mesh_layout import TP_MODES
from megalite.core.moe.config import (
    DISPATCHERS,
    DROP_POLICIES,
    LOAD_BALANCING_TYPES,
    SCORE_FUNCTIONS,
)
from megalite.core.optimizer.compressed import OPTIMIZERS
from megalite.core.pipeline_parallel.generators import SCHEDULES
from megalite.models.config import (
    ATTENTION_BACKENDS,
    NORMALIZATIONS,
    POSITION_EMBEDDING_TYPES,
    RECOMPUTE_GRANULARITIES,
    RECOMPUTE_METHODS,
    GPTConfig,
)
from megalite.training.flag_groups import FlagGroup, Parser, int_or_list, window_pair
from megalite.training.lr_scheduler import DECAY_STYLES
from megalite.training.megatron_flags import add_ignored_flags
from megalite.training.optimizer_config import OptimizerConfig
from megalite.training.parallel_config import DEVICES, ParallelConfig
from megalite.training.run_flags import data_flags, logging_flags, training_flags

# Megatron's --attention-backend values map onto the two megalite implements.
ATTENTION_BACKEND_ALIASES = {
    "sdpa": "sdpa",
    "unfused": "unfused",
    "auto": "sdpa",
    "flash": "sdpa",
    "fused": "sdpa",
    "local": "unfused",
}


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="pretrain_gpt.py",
        allow_abbrev=False,
        description="Megatron-LM's command-line flags -> a validated PretrainConfig.",
    )
    _model_flags(p)
    _parallel_flags(p)
    _optimizer_flags(p)
    training_flags(p)
    _moe_flags(p)
    data_flags(p)
    logging_flags(p)
    add_ignored_flags(p)
    return p


def _model_flags(p: argparse.ArgumentParser) -> None:
    m = FlagGroup(p, "model", GPTConfig)
    for flag in ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length"):
        m.add(flag, type=int, required=True)
    for flag in ("--ffn-hidden-size", "--kv-channels", "--num-query-groups"):
        m.add(flag, type=int)
    m.plain("--group-query-attention", action="store_true")
    m.add("--max-position-embeddings", type=int)
    m.add("--position-embedding-type", choices=POSITION_EMBEDDING_TYPES)
    m.plain(
        "--use-rotary-position-embeddings",
        action="store_true",
        help="Megatron's old alias of --position-embedding-type rope",
    )
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
    m.add("--recompute-granularity", choices=RECOMPUTE_GRANULARITIES)
    m.plain(
        "--recompute-activations",
        action="store_true",
        help="Megatron's alias of --recompute-granularity selective",
    )
    m.add("--recompute-method", choices=RECOMPUTE_METHODS)
    m.add("--recompute-num-layers", type=int)
    m.switch(
        "--cpu-offloading", help="saved activations of the first layers of a chunk on the host"
    )
    m.add(
        "--cpu-offloading-num-layers",
        type=int,
        help="N: the first N transformer layers of each model chunk (with --cpu-offloading)",
    )
    kernels = "use the PyTorch reference instead of the Triton kernels"
    for flag in ("--no-fused-kernels", "--no-masked-softmax-fusion", "--no-persist-layer-norm"):
        m.plain(flag, dest="no_fused_kernels", action="store_true", help=kernels)
    m.add("--window-size", type=window_pair, help="LEFT,RIGHT: sliding-window attention")
    m.add("--window-attn-skip-freq", type=int_or_list, help="N (every N-th layer full) or [1,1,0]")
    m.add("--sparse-attention", choices=SPARSE_LAYOUTS, help="a block-sparse layout")
    for flag in (
        "--sparse-block-size",
        "--sparse-num-local-blocks",
        "--sparse-num-global-blocks",
        "--sparse-num-window-blocks",
        "--sparse-num-random-blocks",
        "--attention-block-size",
    ):
        m.add(flag, type=int)
    m.add("--decoder-first-pipeline-num-layers", type=int)
    m.add("--decoder-last-pipeline-num-layers", type=int)
    for what, stage in (("embedding", "first"), ("loss", "last")):
        m.plain(
            f"--account-for-{what}-in-pipeline-split",
            action="store_true",
            help=f"the {what} counts as a layer: the {stage} stage holds one layer fewer",
        )
    # Megatron's options of the math
    m.switch("--apply-layernorm-1p", help="norm weights stored as w - 1, applied as 1 + w")
    m.switch("--qk-layernorm", help="a norm over each head's query and key")
    m.switch("--squared-relu", help="relu(x)^2 instead of GELU in the MLP")
    m.add("--rotary-percent", type=float, help="RoPE on this share of each head's channels")
    m.switch("--rotary-interleaved", help="RoPE pairs channels (2i, 2i+1)")
    m.switch("--use-rope-scaling", help="Llama 3.1 RoPE frequency scaling")
    m.add("--rope-scaling-factor", type=float, help="Llama 3.1 RoPE scaling factor (8)")


def _parallel_flags(p: argparse.ArgumentParser) -> None:
    par = FlagGroup(p, "parallelism", ParallelConfig, GPTConfig)
    par.add("--tensor-model-parallel-size", type=int)
    par.add(
        "--tensor-parallel-mode",
        choices=TP_MODES,
        help="how layers split inside the tensor group: 1d (Megatron), 2d (q x q), "
        "2.5d (depth x q x q), 3d (q x q x q)",
    )
    par.add("--tensor-parallel-depth", type=int, help="2.5d: the stacked q x q grids (d)")
    par.add("--pipeline-model-parallel-size", type=int)
    par.add("--pipeline-schedule", choices=SCHEDULES)
    for flag in (
        "--sequence-parallel",
        "--use-distributed-optimizer",
        "--overlap-grad-reduce",
        "--overlap-param-gather",
        "--accumulate-allreduce-grads-in-fp32",
    ):
        par.switch(flag)
    par.switch(
        "--grad-reduce-in-bf16",
        help="with --bf16: grads accumulated and reduced over DP in bf16 (default: fp32)",
    )
    par.switch(
        "--use-tp-pp-dp-mapping",
        help="rank order tp-cp-ep-pp-dp: DP the slowest axis instead of PP",
    )
    # virtual pipeline stages: several model chunks per rank
    par.add("--num-layers-per-virtual-pipeline-stage", type=int)
    par.add("--num-virtual-stages-per-pipeline-rank", type=int)
    par.add("--microbatch-group-size-per-virtual-pipeline-stage", type=int)
    par.switch(
        "--no-overlap-p2p-communication",
        help="wait for each stage-to-stage receive where it is posted",
    )
    par.add("--ddp-bucket-size", type=int)
    par.add("--ddp-num-buckets", type=int, help="bucket size = this rank's parameters // N")
    par.add(
        "--distributed-timeout-minutes",
        type=float,
        default=None,  # given: the hang watchdog is on (arguments.build_config); else 10
        help="collective timeout; given, the hang watchdog explains a rank stuck this long",
    )
    par.switch(
        "--hang-watchdog",
        help="record every collective and explain a hang at --distributed-timeout-minutes "
        "(on when that flag is given)",
    )
    par.plain("--distributed-backend", choices=["nccl", "gloo"])
    par.add("--device", choices=DEVICES)

    cp = FlagGroup(p, "context parallel", ParallelConfig, GPTConfig)
    cp.add(
        "--context-parallel-size",
        type=int,
        help="split each sequence over N ranks (2 x N load-balanced chunks)",
    )
    cp.add(
        "--cp-comm-type",
        choices=CP_COMM_TYPES,
        help="p2p: K/V ring; a2a: Ulysses all-to-all; all_gather: K/V gathered",
    )

    z = FlagGroup(p, "sharded data parallelism (ZeRO) and optimizer offload", ParallelConfig)
    z.add(
        "--data-parallel-sharding-strategy",
        choices=STRATEGIES,
        help="no_shard (DDP), optim (ZeRO-1), optim_grads (ZeRO-2), optim_grads_params (ZeRO-3)",
    )
    z.add(
        "--zero-stage",
        type=int,
        choices=range(len(STRATEGIES)),
        help="DeepSpeed's alias of --data-parallel-sharding-strategy",
    )
    z.switch("--optimizer-cpu-offload", help="fp32 masters, Adam moments and the step on the host")
    z.add(
        "--optimizer-offload-fraction",
        type=float,
        help="share of the optimizer state (and step) offloaded, in [0, 1]",
    )
    z.add(
        "--optimizer-offload-dir",
        help="NVMe offload: the offloaded optimizer state in files under DIR",
    )
    z.add(
        "--optimizer-offload-host-memory-mb",
        type=float,
        help="bound on the host buffers that stream the NVMe state (MiB)",
    )
    z.switch(
        "--param-cpu-offload", help="ZeRO-3: the parameter shards on the host, streamed per unit"
    )
    z.add(
        "--param-offload-dir",
        help="ZeRO-Infinity: the parameter shards in files under DIR, read one unit ahead",
    )
    z.add(
        "--param-offload-host-memory-mb",
        type=float,
        help="bound on the host buffers that stream the parameter files (MiB)",
    )


def _optimizer_flags(p: argparse.ArgumentParser) -> None:
    o = FlagGroup(p, "optimizer and mixed precision", OptimizerConfig)
    o.add("--optimizer", choices=OPTIMIZERS, help="adam is AdamW; the compressed ones: --onebit-*")
    o.add("--lamb-min-trust-ratio", type=float, help="LAMB's lower bound on ||w|| / ||update||")
    o.add("--lamb-max-trust-ratio", type=float, help="LAMB's upper bound on ||w|| / ||update||")
    o.add(
        "--onebit-freeze-step",
        type=int,
        help="onebit-adam / onebit-lamb: full-precision steps before the momentum is compressed",
    )
    o.add(
        "--onebit-lamb-factor-max",
        type=float,
        help="onebit-lamb: upper bound on the fresh-variance factor of the frozen trust ratio",
    )
    o.add("--onebit-lamb-factor-min", type=float, help="onebit-lamb: its lower bound")
    o.add(
        "--onebit-lamb-factor-threshold",
        type=float,
        help="onebit-lamb: the factor's largest relative change per step",
    )
    o.add("--zero-one-var-freeze-step", type=int, help="zero-one-adam: the variance's last update")
    o.add(
        "--zero-one-var-update-scaler",
        type=int,
        help="zero-one-adam: variance updates before their interval doubles",
    )
    o.add(
        "--zero-one-local-step-scaler",
        type=int,
        help="zero-one-adam: steps before the sync interval doubles (after the variance freeze)",
    )
    o.add("--zero-one-local-step-clipper", type=int, help="zero-one-adam: longest sync interval")
    o.add("--lr", type=float, required=True)
    o.add("--min-lr", type=float)
    o.add("--decoupled-lr", type=float, help="the word embedding and output layer's own --lr")
    o.add("--decoupled-min-lr", type=float, help="their own --min-lr (default: --min-lr)")
    o.add("--lr-decay-style", choices=DECAY_STYLES)
    o.add("--lr-decay-iters", type=int)
    o.add("--lr-warmup-iters", type=int)
    # Megatron's sample-based schedule, in (fractional) iterations of the global batch
    o.plain("--lr-warmup-samples", type=int, default=None)
    o.plain("--lr-decay-samples", type=int, default=None)
    for flag in (
        "--lr-warmup-fraction",
        "--lr-warmup-init",
        "--weight-decay",
        "--clip-grad",
        "--adam-beta1",
        "--adam-beta2",
        "--adam-eps",
        "--loss-scale",
        "--initial-loss-scale",
        "--min-loss-scale",
    ):
        o.add(flag, type=float)
    # the parameters' dtype: GPTConfig.params_dtype
    o.plain("--bf16", action="store_true")
    o.plain("--fp16", action="store_true")
    o.add("--loss-scale-window", type=int)
    o.add("--hysteresis", type=int)


def _moe_flags(p: argparse.ArgumentParser) -> None:
    moe = FlagGroup(p, "mixture of experts", GPTConfig)
    for flag in (
        "--num-experts",
        "--moe-ffn-hidden-size",
        "--moe-router-topk",
        "--moe-shared-expert-intermediate-size",
    ):
        moe.add(flag, type=int)
    moe.add("--moe-router-score-function", choices=SCORE_FUNCTIONS)
    moe.add("--moe-router-load-balancing-type", choices=LOAD_BALANCING_TYPES)
    for flag in (
        "--moe-aux-loss-coeff",
        "--moe-z-loss-coeff",
        "--moe-router-bias-update-rate",
        "--moe-expert-capacity-factor",
    ):
        moe.add(flag, type=float)
    moe.add("--moe-token-drop-policy", choices=DROP_POLICIES)
    moe.add("--moe-token-dispatcher-type", choices=DISPATCHERS)
    moe.add("--moe-layer-freq", type=int_or_list, help="N (every N-th layer) or [1,0,1,0]")
    for flag in (
        "--moe-router-pre-softmax",
        "--moe-router-enable-expert-bias",
        "--moe-pad-expert-input-to-capacity",
        "--moe-grouped-gemm",
        "--moe-shared-expert-gate",
    ):
        moe.switch(flag)
    moe.switch("--add-qkv-bias", help="a bias on the QKV projection only (Qwen2, Qwen2-MoE)")
    moe.plain(
        "--moe-router-dtype",
        choices=("fp32", "fp64"),
        default=None,
        help="fp32: megalite's router math, always (fp64 is refused)",
    )
    ep = FlagGroup(p, "expert parallelism", ParallelConfig)
    ep.add("--expert-model-parallel-size", type=int)
    ep.add("--expert-tensor-parallel-size", type=int)

"""Megatron-LM's own code on CPU processes (gloo), for ``make_megatron_fixtures.py``.

What megatron-core needs to run on a CPU-only machine (``cpu_patches``, ``cuda_named_types``,
``inline_writers``, ``keep_adam_step``: each says what it works around and why it changes no
value), the flags of the fixtures' tiny Llama-style model (``FLAGS``), Megatron's parsed ``args``
(``megatron_args``), the model chunk with its optimizer and scheduler (``build``), the Adam state
its optimizer holds (``adam_state``) and the launch of N processes (``spawn``). megatron-core and
Megatron-LM are not dependencies of megalite: they are imported inside the functions that use them.
"""

from __future__ import annotations

import os
import queue
import random
import sys
import types

import torch
import torch.multiprocessing as mp

# the fixtures' model and run, as Megatron-LM's flags
FLAGS = (
    "--num-layers 4 --hidden-size 32 --num-attention-heads 4 --group-query-attention "
    "--num-query-groups 2 --ffn-hidden-size 48 --seq-length 16 --max-position-embeddings 16 "
    "--position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear "
    "--untie-embeddings-and-output-weights --vocab-size 128 --make-vocab-size-divisible-by 16 "
    "--tokenizer-type NullTokenizer --micro-batch-size 2 --global-batch-size 4 --lr 1e-3 "
    "--min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 1 --train-iters 10 "
    "--weight-decay 0.1 --clip-grad 1.0 --attention-dropout 0.0 --hidden-dropout 0.0 "
    "--transformer-impl local --no-gradient-accumulation-fusion --no-masked-softmax-fusion "
    "--no-bias-swiglu-fusion --no-rope-fusion --no-persist-layer-norm "
    "--use-cpu-initialization --distributed-backend gloo --seed 1234 --init-method-std 0.02 "
    "--attention-backend unfused"
).split()
ITERATION = 2
CONSUMED = ITERATION * 4
TOKENS_SEED = 7
VOCAB = 128  # a multiple of 16 x TP: no padding rows at TP 1, 2, 4 (Megatron pads per TP)


def cpu_patches() -> None:
    """Megatron asks CUDA for a device and RNG state; on this CPU-only build answer for the CPU."""
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda *a, **k: None
    torch.cuda.manual_seed = lambda *a, **k: None
    torch.cuda.synchronize = lambda *a, **k: None
    for name in ("tensor", "zeros", "empty", "ones", "full", "arange"):
        setattr(torch, name, _on_cpu(getattr(torch, name)))


def cuda_named_types() -> None:
    """Megatron's distributed optimizer accepts parameters whose ``type()`` names a CUDA tensor
    only (``torch.cuda.FloatTensor``, ...): a CPU tensor answers with its CUDA name. Nothing else
    changes: the optimizer's own code shards, steps, gathers (gloo) and saves ``distrib_optim.pt``
    as on a GPU; only the device of the tensors differs."""
    plain_type = torch.Tensor.type

    def cuda_named_type(self, *args, **kwargs):
        name = plain_type(self, *args, **kwargs)
        if args or kwargs or not isinstance(name, str) or name.startswith("torch.cuda."):
            return name
        return name.replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = cuda_named_type


class _InlineProcess:
    """Runs its target in this process at start(): Megatron's forked checkpoint writers hang in
    a spawned gloo process on this machine."""

    exitcode = 0

    def __init__(self, target, kwargs=None, **_):
        self.target, self.kwargs = target, kwargs or {}

    def start(self):
        self.target(**self.kwargs)

    def join(self, *a):
        pass

    def is_alive(self):
        return False


class _InlineContext:
    Process = _InlineProcess

    def Queue(self):  # noqa: N802 (multiprocessing's names)
        return queue.Queue()

    JoinableQueue = Queue

    def Manager(self):  # noqa: N802
        return self


def inline_writers() -> None:
    """Megatron's asynchronous checkpoint writers run inline (``_InlineProcess``)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async.mp = types.SimpleNamespace(
        get_context=lambda *_: _InlineContext(), SimpleQueue=None, JoinableQueue=None
    )


def _on_cpu(factory):
    def make(*args, **kwargs):
        device = kwargs.get("device")
        if device is not None and "cuda" in str(device):
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    return make


def megatron_args(extra: list[str]):
    import megatron.training.arguments as margs
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.global_vars import set_global_variables

    margs.get_device_arch_version = lambda: 10  # no GPU to ask
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"

    known = FLAGS
    sys.argv = ["make_megatron_fixtures", *known, *extra]
    args = parse_args()
    validate_args(args)
    set_global_variables(args, build_tokenizer=False)
    args.padded_vocab_size = VOCAB
    inline_writers()
    return args


def build(args, tp: int, pp: int):
    """The model chunk (in Megatron's DDP), its optimizer and scheduler on this rank (the
    distributed optimizer and its grad-buffer buckets when ``args`` ask for them)."""
    import megatron.core.tensor_parallel.random as mrandom
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.training.arguments import core_transformer_config_from_args
    from megatron.training.training import get_optimizer_param_scheduler

    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda *a, **k: None
    mpu.initialize_model_parallel(tp, pp)
    torch.manual_seed(args.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    config = core_transformer_config_from_args(args)
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=mpu.is_pipeline_first_stage(),
        post_process=mpu.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
    )
    distopt = bool(args.use_distributed_optimizer)
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=distopt,
        overlap_grad_reduce=bool(args.overlap_grad_reduce),
        bucket_size=args.ddp_bucket_size,
    )
    ddp = DistributedDataParallel(config, ddp_config, model)
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        clip_grad=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_eps=1e-8,
        use_distributed_optimizer=distopt,
    )
    optimizer = get_megatron_optimizer(opt_config, [ddp])
    scheduler = get_optimizer_param_scheduler(optimizer)
    return ddp, optimizer, scheduler


def inner_optimizer(optimizer):
    """The (first) optimizer inside Megatron's: some megatron-core versions wrap theirs in a
    ``ChainedOptimizer`` (``chained_optimizers``), others return it bare."""
    return getattr(optimizer, "chained_optimizers", [optimizer])[0]


def adam_state(ddp, optimizer, distributed: bool) -> dict:
    """The Adam state Megatron's optimizer holds after a load, by parameter name (one process:
    a distributed optimizer's shard is the whole parameter)."""
    out = {}
    optimizer = inner_optimizer(optimizer)
    for name, param in ddp.module.named_parameters():
        if distributed:
            t = optimizer._get_main_param_and_optimizer_states(param)
            master, state = t["param"], t
        else:
            state = optimizer.optimizer.state[param]
            master = param
        out[name] = {
            "master": master.detach().reshape(param.shape).float().clone(),
            "exp_avg": state["exp_avg"].reshape(param.shape).float().clone(),
            "exp_avg_sq": state["exp_avg_sq"].reshape(param.shape).float().clone(),
        }
    return out


def keep_adam_step() -> None:
    """megatron-core 0.16 without Transformer Engine or Apex falls back to torch's Adam, whose
    per-parameter state holds a ``step``; ``DistributedOptimizer._set_main_param_and_optimizer_
    states`` then copies every key of that state from the ``distrib_optim.pt`` ranges, which hold
    none (KeyError 'step', for Megatron's own files as well). The step is already set from the
    param groups by ``load_state_dict``: keep it, copy the rest as Megatron does."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    plain = DistributedOptimizer._set_main_param_and_optimizer_states

    def set_states(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        state = self.optimizer.state[main_param]
        if "step" in state and "step" not in tensors:
            tensors = {**tensors, "step": state["step"].clone()}
        return plain(self, model_param, tensors)

    DistributedOptimizer._set_main_param_and_optimizer_states = set_states


def spawn(target, world: int, *args) -> None:
    """``target(rank, world, port, *args)`` on ``world`` spawned processes (``target(port,
    *args)`` on one); a failed process ends the tool."""
    port = random.randint(20000, 40000)
    if world == 1:
        ctx = mp.get_context("spawn")
        p = ctx.Process(target=target, args=(port, *args))
        p.start()
        p.join()
        if p.exitcode:
            raise SystemExit(f"megatron process failed ({p.exitcode})")
        return
    mp.start_processes(
        rank_entry, args=(target, world, port, *args), nprocs=world, start_method="spawn"
    )


def rank_entry(rank: int, target, world: int, port: int, *args) -> None:
    target(rank, world, port, *args)

"""Megatron-LM's own code on CPU processes (gloo), for ``make_megatron_fixtures.py``.

What megatron-core needs to run on a CPU-only machine (``cpu_patches``, ``cuda_named_types``,
``inline_writers``, ``keep_adam_step``: each says what it works around and why it changes no
value), the flags of the fixtures' tiny Llama-style model (``FLAGS``), Megatron's parsed ``args``
(``megatron_args``), the model chunk with its optimizer and scheduler (``build``), the Adam state
its optimizer holds (``adam_state``) and the launch of N processes (``spawn``). megatron-core and
Megatron-LM are not dependencies of megalite: they are imported inside the functions that use them.
"""

from __future__ import annotations

import contextlib
import os
import queue
import random
import struct
import sys
import types
from collections.abc import Callable

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
SEQ = 16
VOCAB = 128  # a multiple of 16 x TP: no padding rows at TP 1, 2, 4 (Megatron pads per TP)


def _patch(obj, name: str, value, undo: list) -> None:
    undo.append((obj, name, getattr(obj, name)))
    setattr(obj, name, value)


def _undoer(undo: list) -> Callable[[], None]:
    def undo_all() -> None:
        for obj, name, value in reversed(undo):
            setattr(obj, name, value)
        undo.clear()

    return undo_all


class PhiloxCudaRng:
    """The CUDA generator's state as torch saves it, kept on a machine without CUDA: 16 bytes, the
    seed then the Philox offset, both 64-bit little-endian (``CUDAGeneratorImpl::get_state``).
    Megatron seeds it (``manual_seed``), reads and sets it (``get_rng_state``/``set_rng_state``,
    its tracker's ``add`` and ``fork``) and saves it as on a GPU; nothing on the CPU draws from
    it, so the offset stays at 0 after a seeding, as on a GPU run without dropout."""

    def __init__(self, seed: int = 67280421310721):  # torch's default CUDA seed
        self.seed, self.offset = seed, 0

    def manual_seed(self, seed, *_, **__) -> None:
        self.seed, self.offset = int(seed) % 2**64, 0

    def get_state(self, *_, **__) -> torch.Tensor:
        raw = struct.pack("<Qq", self.seed, self.offset)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone()

    def set_state(self, state: torch.Tensor, *_, **__) -> None:
        self.seed, self.offset = struct.unpack("<Qq", bytes(state.to(torch.uint8).tolist()))


def cpu_patches(*, cuda_rng: PhiloxCudaRng | None = None) -> Callable[[], None]:
    """Megatron asks CUDA for a device and RNG state; on this CPU-only build answer for the CPU:
    the CPU generator's state stands in for the CUDA one, or ``cuda_rng`` keeps a CUDA-format
    state (``PhiloxCudaRng``). Returns the function that undoes the patches."""
    undo: list = []
    _patch(torch.cuda, "current_device", lambda: "cpu", undo)
    if cuda_rng is None:
        _patch(torch.cuda, "get_rng_state", lambda *a, **k: torch.get_rng_state(), undo)
        _patch(torch.cuda, "set_rng_state", lambda *a, **k: None, undo)
        _patch(torch.cuda, "manual_seed", lambda *a, **k: None, undo)
    else:
        _patch(torch.cuda, "get_rng_state", cuda_rng.get_state, undo)
        _patch(torch.cuda, "set_rng_state", cuda_rng.set_state, undo)
        _patch(torch.cuda, "manual_seed", cuda_rng.manual_seed, undo)
    _patch(torch.cuda, "synchronize", lambda *a, **k: None, undo)
    # megatron-core's own accessors of the CUDA generator, as answered above
    import megatron.core.tensor_parallel.random as mrandom

    _patch(mrandom, "_get_cuda_rng_state", lambda *a, **k: torch.cuda.get_rng_state(), undo)
    _patch(mrandom, "_set_cuda_rng_state", lambda s, *a, **k: torch.cuda.set_rng_state(s), undo)
    for name in ("tensor", "zeros", "empty", "ones", "full", "arange"):
        _patch(torch, name, _on_cpu(getattr(torch, name)), undo)
    return _undoer(undo)


def cuda_named_types() -> Callable[[], None]:
    """Megatron's optimizers accept parameters whose ``type()`` names a CUDA tensor only
    (``torch.cuda.FloatTensor``, ``torch.cuda.BFloat16Tensor``, ...): a CPU tensor answers with
    its CUDA name. Nothing else changes: the optimizers' own code copies the fp32 masters, shards,
    steps, gathers (gloo) and saves as on a GPU; only the device of the tensors differs. Returns
    the function that undoes it."""
    plain_type = torch.Tensor.type

    def cuda_named_type(self, *args, **kwargs):
        name = plain_type(self, *args, **kwargs)
        if args or kwargs or not isinstance(name, str) or name.startswith("torch.cuda."):
            return name
        return name.replace("torch.", "torch.cuda.", 1)

    undo: list = []
    _patch(torch.Tensor, "type", cuda_named_type, undo)
    return _undoer(undo)


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
    """The model chunk (in Megatron's DDP), its optimizer and scheduler on this rank from
    Megatron-LM's ``args`` (the distributed optimizer and its grad-buffer buckets when they ask
    for them), configured as Megatron-LM's ``get_model`` and ``setup_model_and_optimizer`` do."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.training.arguments import core_transformer_config_from_args
    from megatron.training.training import get_optimizer_param_scheduler

    distopt = bool(args.use_distributed_optimizer)
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=distopt,
        overlap_grad_reduce=bool(args.overlap_grad_reduce),
        bucket_size=args.ddp_bucket_size,
        grad_reduce_in_fp32=bool(args.accumulate_allreduce_grads_in_fp32),
    )
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
        bf16=bool(args.bf16),
        params_dtype=args.params_dtype,
    )
    config = core_transformer_config_from_args(args)
    ddp, optimizer = build_core(config, ddp_config, opt_config, tp=tp, pp=pp, seed=args.seed)
    return ddp, optimizer, get_optimizer_param_scheduler(optimizer)


def core_configs(tp: int, pp: int, *, bf16: bool, distributed_optimizer: bool = False):
    """The fixtures' model (``FLAGS``) as megatron-core's own configs, without Megatron-LM: the
    TransformerConfig, DDP config and optimizer config Megatron-LM derives from those flags
    (``--bf16``: bf16 parameters, fp32 grads as Megatron's default)."""
    import torch.nn.functional as F
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnBackend

    dtype = torch.bfloat16 if bf16 else torch.float32
    config = TransformerConfig(
        num_layers=4,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=48,
        kv_channels=8,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.02,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        bf16=bf16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=True,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        attention_backend=AttnBackend.unfused,
        attention_softmax_in_fp32=False,  # Megatron-LM's default, not megatron-core's
        transformer_impl="local",
        cp_comm_type="p2p",
        deallocate_pipeline_outputs=True,
    )
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=distributed_optimizer, grad_reduce_in_fp32=True
    )
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=1e-3,
        min_lr=1e-4,
        weight_decay=0.1,
        clip_grad=0.0,
        use_distributed_optimizer=distributed_optimizer,
        bf16=bf16,
        params_dtype=dtype,
    )
    return config, ddp_config, opt_config


def build_core(config, ddp_config, opt_config, *, tp: int, pp: int, seed: int):
    """megatron-core only: the model parallel groups (TP x PP, DP what is left), the seeded RNG
    tracker, the fixtures' GPTModel (local layer spec, RoPE, untied output) in a Float16Module
    under bf16 (as Megatron-LM's ``get_model``), Megatron's DDP and optimizer. Returns
    ``(ddp, optimizer)``."""
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    mpu.initialize_model_parallel(tp, pp)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        pre_process=mpu.is_pipeline_first_stage(),
        post_process=mpu.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
    )
    if config.bf16:  # as Megatron-LM's get_model: bf16 parameters, fp32 logits
        model = Float16Module(config, model)
    ddp = DistributedDataParallel(config, ddp_config, model)
    return ddp, get_megatron_optimizer(opt_config, [ddp])


def inner_optimizer(optimizer):
    """The (first) optimizer inside Megatron's: some megatron-core versions wrap theirs in a
    ``ChainedOptimizer`` (``chained_optimizers``), others return it bare."""
    return getattr(optimizer, "chained_optimizers", [optimizer])[0]


def gpt_model(ddp):
    """The GPTModel inside Megatron's DDP (and its Float16Module under --bf16): the names of
    its parameters are the checkpoint's."""
    from megatron.core.transformer.module import Float16Module

    module = ddp.module
    return module.module if isinstance(module, Float16Module) else module


def adam_shards(ddp, optimizer) -> dict:
    """What megatron-core's optimizer holds on this rank, by the GPTModel's parameter names:
    ``{name: {"range": (start, end), "master", "exp_avg", "exp_avg_sq" (fp32, flat over that
    range of the parameter's elements), "step"}}``. The range is the whole parameter except under
    the distributed optimizer (this DP rank's range; parameters with none are left out). The
    master is the fp32 parameter the optimizer steps: the model parameter itself
    (FP32Optimizer), its fp32 copy (Float16OptimizerWithFloat16Params: ``fp32_from_float16_
    groups``) or the distributed optimizer's main shard."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    optimizer = inner_optimizer(optimizer)
    distributed = isinstance(optimizer, DistributedOptimizer)
    main_of = {}  # FP32Optimizer has no fp32 copies (nor these attributes)
    for model_group, main_group in zip(
        getattr(optimizer, "float16_groups", []), getattr(optimizer, "fp32_from_float16_groups", [])
    ):
        main_of.update({id(p): m for p, m in zip(model_group, main_group)})
    out = {}
    for name, param in gpt_model(ddp).named_parameters():
        if distributed:
            if param not in optimizer.model_param_group_index_map:
                continue
            state = optimizer._get_main_param_and_optimizer_states(param)
            master = state["param"]
            span = optimizer._get_model_param_range_map(param)["param"]
            start, end = span.start, span.end
        else:
            master = main_of.get(id(param), param)
            state = optimizer.optimizer.state[master]
            start, end = 0, param.numel()
        out[name] = {
            "range": (start, end),
            "master": master.detach().reshape(-1).float().clone(),
            "exp_avg": state["exp_avg"].reshape(-1).float().clone(),
            "exp_avg_sq": state["exp_avg_sq"].reshape(-1).float().clone(),
            "step": int(state["step"]),
        }
    return out


def adam_state(ddp, optimizer) -> dict:
    """The Adam state Megatron's optimizer holds after a load, by parameter name, in the
    parameters' shapes (one process: every range is the whole parameter)."""
    shapes = {n: p.shape for n, p in gpt_model(ddp).named_parameters()}
    return {
        name: {k: shard[k].reshape(shapes[name]) for k in ("master", "exp_avg", "exp_avg_sq")}
        for name, shard in adam_shards(ddp, optimizer).items()
    }


def keep_adam_step() -> Callable[[], None]:
    """megatron-core 0.16 without Transformer Engine or Apex falls back to torch's Adam, whose
    per-parameter state holds a ``step``; ``DistributedOptimizer._set_main_param_and_optimizer_
    states`` then copies every key of that state from the ``distrib_optim.pt`` ranges, which hold
    none (KeyError 'step', for Megatron's own files as well). The step is already set from the
    param groups by ``load_state_dict``: keep it, copy the rest as Megatron does. Returns the
    function that undoes it."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    plain = DistributedOptimizer._set_main_param_and_optimizer_states

    def set_states(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        state = self.optimizer.state[main_param]
        if "step" in state and "step" not in tensors:
            tensors = {**tensors, "step": state["step"].clone()}
        return plain(self, model_param, tensors)

    undo: list = []
    _patch(DistributedOptimizer, "_set_main_param_and_optimizer_states", set_states, undo)
    return _undoer(undo)


@contextlib.contextmanager
def megatron_core_on_cpu():
    """``cpu_patches``, ``cuda_named_types`` and ``keep_adam_step`` while megatron-core runs in a
    process that then goes on to other work (a test's worker): undone on exit, with
    megatron-core's model-parallel groups destroyed."""
    undo = [cpu_patches(), cuda_named_types(), keep_adam_step()]
    try:
        yield
    finally:
        from megatron.core import parallel_state as mpu

        mpu.destroy_model_parallel()
        for undo_one in reversed(undo):
            undo_one()


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

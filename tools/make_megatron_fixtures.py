"""Write Megatron-LM checkpoints with Megatron's own save path (tests/fixtures/megatron_ckpt/).

    # megatron-core 0.16 (wheel) + megatron/{training,rl,post_training,legacy} of Megatron-LM's
    # core_r0.16.0 branch in /tmp/mlm016; psutil in the interpreter (a venv); no GPU needed
    PYTHONPATH=/tmp/mcore/site:/tmp/mlm016 python tools/make_megatron_fixtures.py [--output DIR]
    PYTHONPATH=/tmp/mcore/site:/tmp/mlm016 python tools/make_megatron_fixtures.py \
        --check-load DIR --ckpt-format torch_dist      # megalite's files through Megatron's loader
        [--distributed-optimizer]                       # (torch: its distrib_optim.pt)

Neither is a dependency of megalite: the tests read only the committed files. On 4 CPU processes
(gloo) a tiny Llama-style GPTModel (local layer spec: RoPE, RMSNorm, SwiGLU, GQA, untied output)
is built at TP 2 x PP 2, its Adam state made non-trivial by two optimizer steps on seeded random
gradients, and ``megatron.training.checkpointing.save_checkpoint`` writes iteration 2 twice:
``legacy_tp2_pp2`` (``--ckpt-format torch``: ``model_optim_rng.pt`` per (TP, PP) rank) and
``dist_tp2_pp2`` (``--ckpt-format torch_dist``). On 8 processes the same run at TP 2 x PP 2 x
DP 2 with ``--use-distributed-optimizer --overlap-grad-reduce --ddp-bucket-size 540`` writes
``legacy_distopt_tp2_pp2_dp2`` (``--ckpt-format torch``: ``distrib_optim.pt`` beside each
``model_optim_rng.pt``; ``--only-distopt`` writes just that one). Megatron's distributed
optimizer refuses parameters that are not CUDA tensors by their ``type()`` name; on this CPU-only
machine the parameters answer with their CUDA name (``_cuda_named_types``), which changes nothing
else: Megatron's own code shards, steps, gathers over gloo and saves. Then one process loads
``dist_tp2_pp2`` at TP 1 x PP 1 with Megatron's ``load_checkpoint`` and writes the logits of
fixed tokens to ``reference.pt``: the source model's function, which every megalite load must
reproduce.

``--check-load DIR`` runs only that last step on a checkpoint megalite wrote and compares its
logits with ``DIR``'s ``reference.pt`` (written beside it by the caller), and the Adam state
Megatron's optimizer then holds with the one megalite reads from the same files; exit status 0
when both match. ``--layout TP PP DP`` loads it at that layout instead (TP x PP x DP processes;
the logits pipelined by hand and gathered over TP); with ``--distributed-optimizer`` (and
``--bucket-flags``, the grad-buffer flags of the megalite run) the Adam state Megatron then
holds, gathered by its own ``get_parameter_state_dp_zero`` per (TP, PP) rank, must equal the
flat tensors of ``--distopt-ref DIR``'s ``distrib_optim.pt`` files exactly (megalite's, in the
torch format: so a torch_dist load is checked against the same state).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

import torch

FLAGS = [
    "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
    "--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "48",
    "--seq-length", "16",
    "--max-position-embeddings", "16", "--position-embedding-type", "rope",
    "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
    "--untie-embeddings-and-output-weights", "--vocab-size", "128",
    "--make-vocab-size-divisible-by", "16", "--tokenizer-type", "NullTokenizer",
    "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3", "--min-lr", "1e-4",
    "--lr-decay-style", "cosine", "--lr-warmup-iters", "1", "--train-iters", "10",
    "--weight-decay", "0.1", "--clip-grad", "1.0", "--attention-dropout", "0.0",
    "--hidden-dropout", "0.0", "--transformer-impl", "local", "--no-gradient-accumulation-fusion",
    "--no-masked-softmax-fusion", "--no-bias-swiglu-fusion", "--no-rope-fusion",
    "--no-persist-layer-norm",
    "--use-cpu-initialization", "--distributed-backend", "gloo", "--seed", "1234",
    "--init-method-std", "0.02", "--attention-backend", "unfused",
]  # fmt: skip
ITERATION = 2
CONSUMED = ITERATION * 4
TOKENS_SEED = 7
DISTOPT = "legacy_distopt_tp2_pp2_dp2"
VOCAB = 128  # a multiple of 16 x TP: no padding rows at TP 1, 2, 4 (Megatron pads per TP)


def _cpu_patches() -> None:
    """Megatron asks CUDA for a device and RNG state; on this CPU-only build answer for the CPU."""
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda *a, **k: None
    torch.cuda.manual_seed = lambda *a, **k: None
    torch.cuda.synchronize = lambda *a, **k: None
    for name in ("tensor", "zeros", "empty", "ones", "full", "arange"):
        setattr(torch, name, _on_cpu(getattr(torch, name)))


def _cuda_named_types() -> None:
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
        import queue

        return queue.Queue()

    JoinableQueue = Queue

    def Manager(self):  # noqa: N802
        return self


def _inline_writers() -> None:
    import types

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


def _megatron_args(extra: list[str]):
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
    _inline_writers()
    return args


def _build(args, tp: int, pp: int):
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
        optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
        clip_grad=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8,
        use_distributed_optimizer=distopt,
    )  # fmt: skip
    optimizer = get_megatron_optimizer(opt_config, [ddp])
    scheduler = get_optimizer_param_scheduler(optimizer)
    return ddp, optimizer, scheduler


def _train_on_random_grads(ddp, optimizer, scheduler, args) -> None:
    from megatron.core import parallel_state as mpu

    gen = torch.Generator().manual_seed(100 + mpu.get_tensor_model_parallel_rank())
    for _ in range(ITERATION):
        for p in ddp.module.parameters():
            g = torch.randn(p.shape, generator=gen) * 0.01
            p.main_grad.copy_(g)
        optimizer.step()
        scheduler.step(increment=args.global_batch_size)
    args.consumed_train_samples = CONSUMED


def _save_rank(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank))
    os.environ.update(WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    _cpu_patches()
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    args = _megatron_args(
        ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    )
    ddp, optimizer, scheduler = _build(args, 2, 2)
    _train_on_random_grads(ddp, optimizer, scheduler, args)
    from megatron.training.checkpointing import save_checkpoint

    for fmt, name in (("torch", "legacy_tp2_pp2"), ("torch_dist", "dist_tp2_pp2")):
        args.ckpt_format, args.use_dist_ckpt = fmt, fmt != "torch"
        args.save = os.path.join(out, name)
        save_checkpoint(ITERATION, [ddp], optimizer, scheduler, 0)
    torch.distributed.destroy_process_group()


def _save_distopt_rank(rank: int, world: int, port: int, out: str) -> None:
    """TP 2 x PP 2 x DP 2 with the distributed optimizer and small grad-buffer buckets:
    ``--ckpt-format torch`` writes ``distrib_optim.pt`` (DP rank 0's gather of the flat buckets)
    beside each ``model_optim_rng.pt``. The same seeded gradients on both DP replicas, so the
    model and Adam state equal those of ``legacy_tp2_pp2``. 540 elements per bucket: on the first
    stage one bucket closes right after a 32-element norm, so its 64-element alignment padding is
    not in the file (a reader ignoring the buckets gets other sizes)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank))
    os.environ.update(WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    _cpu_patches()
    _cuda_named_types()
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    args = _megatron_args(
        ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
         "--use-distributed-optimizer", "--overlap-grad-reduce", "--ddp-bucket-size", "540"]
    )  # fmt: skip
    ddp, optimizer, scheduler = _build(args, 2, 2)
    _train_on_random_grads(ddp, optimizer, scheduler, args)
    from megatron.training.checkpointing import save_checkpoint

    args.ckpt_format, args.use_dist_ckpt = "torch", False
    args.save = os.path.join(out, DISTOPT)
    save_checkpoint(ITERATION, [ddp], optimizer, scheduler, 0)
    torch.distributed.destroy_process_group()


def _adam_state(ddp, optimizer, distributed: bool) -> dict:
    """The Adam state Megatron's optimizer holds after a load, by parameter name (one process:
    a distributed optimizer's shard is the whole parameter)."""
    out = {}
    optimizer = getattr(optimizer, "chained_optimizers", [optimizer])[0]
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


def _keep_adam_step() -> None:
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


def _logits_rank(port: int, load: str, fmt: str, result: str, extra=()) -> None:
    """One process: Megatron's load_checkpoint of ``load`` at TP 1 x PP 1, logits -> result."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    _cpu_patches()
    distributed = "--use-distributed-optimizer" in extra
    if distributed:
        _cuda_named_types()
        _keep_adam_step()
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    args = _megatron_args(["--load", load, "--ckpt-format", fmt, *extra])
    ddp, optimizer, scheduler = _build(args, 1, 1)
    from megatron.training.checkpointing import load_checkpoint

    # An fp32 model's distributed optimizer keeps views of the parameters as its masters, and
    # load_parameter_state copies into them in place, which autograd refuses outside no_grad;
    # no_grad changes no value loaded.
    with torch.no_grad():
        iteration, _ = load_checkpoint([ddp], optimizer, scheduler)
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(TOKENS_SEED))
    positions = torch.arange(16).unsqueeze(0).expand(2, 16)
    with torch.no_grad():
        logits = ddp.module(tokens, positions, None)  # [b, s, V_pad]
    torch.save(
        {
            "tokens": tokens,
            "logits": logits[..., :VOCAB].clone(),
            "iteration": iteration,
            "consumed_train_samples": args.consumed_train_samples,
            "lr": optimizer.param_groups[0]["lr"],
            "num_steps": scheduler.num_steps,
            "adam": _adam_state(ddp, optimizer, distributed),
        },
        result,
    )
    torch.distributed.destroy_process_group()


def _layout_rank(rank: int, world: int, port: int, cli_args: tuple) -> None:
    """One of TP x PP x DP processes: Megatron's load_checkpoint of a megalite checkpoint at that
    layout; the last stage's TP-gathered logits and each (TP, PP) rank's DP-gathered flat Adam
    state (DP rank 0) -> ``result_dir``."""
    load, fmt, result_dir, extra, tp, pp = cli_args
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank))
    os.environ.update(WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    _cpu_patches()
    distributed = "--use-distributed-optimizer" in extra
    if distributed:
        _cuda_named_types()
        _keep_adam_step()
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    layout = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]
    args = _megatron_args(["--load", load, "--ckpt-format", fmt, *layout, *extra])
    ddp, optimizer, scheduler = _build(args, tp, pp)
    from megatron.core import parallel_state as mpu
    from megatron.training.checkpointing import load_checkpoint

    if distributed and fmt == "torch_dist":
        # megatron-core 0.16 without Transformer Engine or Apex reads Adam's step from the
        # per-parameter state in ``state_dict()``, which the sharded load calls before any state
        # exists (``assert len(steps) == 1``, for Megatron's own files too): give the state its
        # slots first, as Megatron's dummy-state initialiser does; the load then replaces them.
        getattr(optimizer, "chained_optimizers", [optimizer])[
            0
        ]._init_optimizer_states_with_dummy_values()
    with torch.no_grad():  # as _logits_rank
        iteration, _ = load_checkpoint([ddp], optimizer, scheduler)
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(TOKENS_SEED))
    positions = torch.arange(16).unsqueeze(0).expand(2, 16)
    model = ddp.module
    with torch.no_grad():
        if not mpu.is_pipeline_first_stage():
            hidden = torch.empty(16, 2, 32)
            torch.distributed.recv(hidden, src=mpu.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(hidden)
        out = model(tokens, positions, None)
        if not mpu.is_pipeline_last_stage():
            torch.distributed.send(
                out.contiguous(), dst=mpu.get_pipeline_model_parallel_next_rank()
            )
    t, p = mpu.get_tensor_model_parallel_rank(), mpu.get_pipeline_model_parallel_rank()
    d = mpu.get_data_parallel_rank()
    result = {"iteration": iteration, "consumed_train_samples": args.consumed_train_samples}
    if mpu.is_pipeline_last_stage():
        parts = [torch.empty_like(out) for _ in range(tp)]
        torch.distributed.all_gather(
            parts, out.contiguous(), group=mpu.get_tensor_model_parallel_group()
        )
        result["logits"] = torch.cat(parts, dim=-1)[..., :VOCAB].clone()
    if distributed:
        inner = getattr(optimizer, "chained_optimizers", [optimizer])[0]
        result["flat"] = inner.get_parameter_state_dp_zero()
    if d == 0:
        torch.save(result, os.path.join(result_dir, f"rank_{t}_{p}.pt"))
    torch.distributed.destroy_process_group()


def _check_layout(cli, extra: list[str]) -> bool:
    tp, pp, dp = cli.layout
    result_dir = tempfile.mkdtemp()
    _spawn(_layout_rank, tp * pp * dp, (cli.check_load, cli.ckpt_format, result_dir, extra, tp, pp))
    want = torch.load(os.path.join(cli.check_load, "reference.pt"), weights_only=False)
    ok, notes = True, []
    for t in range(tp):
        for p in range(pp):
            got = torch.load(os.path.join(result_dir, f"rank_{t}_{p}.pt"), weights_only=False)
            ok &= got["iteration"] == want["iteration"]
            if "logits" in got:
                err = (got["logits"] - want["logits"]).abs().max() / want["logits"].abs().max()
                notes.append(f"logits (TP {t}) max rel err {err.item():.2e}")
                ok &= err.item() < 1e-5
            if "flat" in got and cli.distopt_ref:
                ref_dir = os.path.join(
                    cli.distopt_ref,
                    sorted(d for d in os.listdir(cli.distopt_ref) if d.startswith("iter_"))[-1],
                )
                shard = f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "")
                ref = torch.load(
                    os.path.join(ref_dir, shard, "distrib_optim.pt"), weights_only=False
                )
                mine, theirs = next(iter(ref[0].values())), next(iter(got["flat"][0].values()))
                same = all(
                    torch.equal(mine[k], theirs[k]) for k in ("param", "exp_avg", "exp_avg_sq")
                )
                notes.append(f"Adam state of {shard} = megalite's: {'yes' if same else 'NO'}")
                ok &= same
    verdict = "ok" if ok else "MISMATCH"
    print(f"Megatron loaded {cli.check_load} ({cli.ckpt_format} {' '.join(extra)}) at TP {tp} x "
          f"PP {pp} x DP {dp}: " + "; ".join(notes) + f" -> {verdict}")  # fmt: skip
    return ok


def _adam_mismatches(load: str, fmt: str, got: dict) -> list[str]:
    """Where the Adam state Megatron loaded differs from the one megalite reads in the same files
    (megalite's readers are checked against Megatron's own files by the tests)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from megalite.checkpoint.files import read_tracker
    from megalite.checkpoint.megatron import open_reader

    iter_dir = os.path.join(load, f"iter_{read_tracker(load):07d}")
    reader = open_reader(iter_dir, fmt)
    want = reader.optimizer_state(0, 0)["params"] if fmt == "torch" else None
    bad = []
    for name, state in got.items():
        expected = want[name] if want is not None else reader.optimizer_tensors(name)
        for key, tensor in state.items():
            if not torch.equal(expected[key].float(), tensor):
                bad.append(f"{name}.{key}")
    return bad


def _spawn(target, world: int, *args) -> None:
    import random

    import torch.multiprocessing as mp

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
        lambda_rank_entry, args=(target, world, port, *args), nprocs=world, start_method="spawn"
    )


def lambda_rank_entry(rank: int, target, world: int, port: int, *args) -> None:
    target(rank, world, port, *args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    here = os.path.dirname(os.path.abspath(__file__))
    parser.add_argument(
        "--output", default=os.path.join(here, "..", "tests", "fixtures", "megatron_ckpt")
    )
    parser.add_argument("--check-load", default=None, help="a checkpoint megalite wrote")
    parser.add_argument("--ckpt-format", default="torch_dist", choices=("torch", "torch_dist"))
    parser.add_argument("--only-distopt", action="store_true", help="write only " + DISTOPT)
    parser.add_argument(
        "--distributed-optimizer",
        action="store_true",
        help="with --check-load: Megatron loads with --use-distributed-optimizer",
    )
    parser.add_argument(
        "--layout",
        type=int,
        nargs=3,
        default=None,
        metavar=("TP", "PP", "DP"),
        help="with --check-load: load at this layout (TP x PP x DP processes)",
    )
    parser.add_argument(
        "--bucket-flags",
        default="",
        help="with --layout: e.g. '--overlap-grad-reduce --ddp-bucket-size 540'",
    )
    parser.add_argument(
        "--distopt-ref",
        default=None,
        help="with --layout: megalite's torch-format save of the same state",
    )
    cli = parser.parse_args()
    if cli.check_load and cli.layout:
        extra = ["--use-distributed-optimizer"] if cli.distributed_optimizer else []
        raise SystemExit(0 if _check_layout(cli, extra + cli.bucket_flags.split()) else 1)
    if cli.check_load:
        result = os.path.join(tempfile.mkdtemp(), "logits.pt")
        extra = ["--use-distributed-optimizer"] if cli.distributed_optimizer else []
        _spawn(_logits_rank, 1, cli.check_load, cli.ckpt_format, result, extra)
        got = torch.load(result, weights_only=False)
        want = torch.load(os.path.join(cli.check_load, "reference.pt"), weights_only=False)
        err = ((got["logits"] - want["logits"]).abs().max() / want["logits"].abs().max()).item()
        bad = _adam_mismatches(cli.check_load, cli.ckpt_format, got["adam"])
        it, seen = got["iteration"], got["consumed_train_samples"]
        print(f"Megatron loaded {cli.check_load} ({cli.ckpt_format}{' + ' if extra else ''}"
              f"{' '.join(extra)}) at iteration {it}: logits max rel err {err:.2e}, consumed "
              f"{seen}, Adam state of {len(got['adam'])} parameters = megalite's: "
              f"{'yes' if not bad else 'NO: ' + ', '.join(bad[:4])}")  # fmt: skip
        ok = err < 1e-5 and got["iteration"] == want["iteration"] and not bad
        raise SystemExit(0 if ok else 1)
    out = os.path.abspath(cli.output)
    if cli.only_distopt:
        shutil.rmtree(os.path.join(out, DISTOPT), ignore_errors=True)
        _spawn(_save_distopt_rank, 8, out)
        print(f"fixtures -> {out}/{DISTOPT}")
        return
    for name in ("legacy_tp2_pp2", "dist_tp2_pp2", DISTOPT):
        shutil.rmtree(os.path.join(out, name), ignore_errors=True)
    os.makedirs(out, exist_ok=True)
    _spawn(_save_rank, 4, out)
    _spawn(_save_distopt_rank, 8, out)
    _spawn(_logits_rank, 1, os.path.join(out, "dist_tp2_pp2"), "torch_dist",
           os.path.join(out, "reference.pt"))  # fmt: skip
    print(f"fixtures -> {out}")


if __name__ == "__main__":
    main()

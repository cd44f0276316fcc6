"""The ZeRO ladder at DP=2 on CPU/gloo: step time and bytes per rank of every rung, beside
DeepSpeed ZeRO-2/3 and torch FSDP2 on the same model; and ZeRO-3's communication volume.

    python tools/bench/bench_zero_ladder.py [--rounds 3] [--steps 3] [--layers 6] [--hidden 384]
    /tmp/venv-ds/bin/python tools/bench/bench_zero_ladder.py        # with DeepSpeed importable
    python tools/bench/bench_zero_ladder.py --volume                # bytes sent, ZeRO-3 vs DDP
    python tools/bench/bench_zero_ladder.py --tiny                  # a seconds-long smoke run
    python tools/bench/bench_zero_ladder.py --kinds zero3-infinity-cpu,deepspeed-zero3-offload

The same GPT-2 (megalite's ``GPTModel`` on ``ParallelState.single()``, fp32, seed-identical) on
two gloo ranks, one thread each. Every set-up runs in a fresh 2-process world of its own (so the
peak RSS is its own), one after the other, ``--rounds`` times in round-robin order; reported are
the medians over rounds of each round's median step time (the slower rank's), and per rank:
megalite's model-state bytes (``memory_report``) and the process's peak RSS growth over the
step loop's baseline (params + grads + optimizer + activations + buffers, all set-ups alike).

ZeRO-Infinity rows: megalite ZeRO-3 with params and optimizer state on the host
(``zero3-infinity-cpu``) or in files under ``--offload-dir`` (``zero3-infinity-nvme``, the host
staging bounded by 64 MiB), beside DeepSpeed ZeRO-3 with ``offload_param`` and
``offload_optimizer`` on the CPU (``deepspeed-zero3-offload``, the client torch AdamW, as
megalite's host step is torch's AdamW; ``deepspeed-zero3-offload-cpuadam``, DeepSpeed's own
``DeepSpeedCPUAdam``, its default for offloaded state; its C++ op is taken prebuilt from torch's
extension cache when there (``bench_cpu_adam.use_prebuilt_deepspeed_op``), else built on first
use, which took 35 minutes on a loaded 2-core machine). Both sides keep params and optimizer state
unpinned (``pin_memory`` is DeepSpeed's default False; megalite pins on CUDA only). There is no
DeepSpeed NVMe row: ``offload_param`` / ``offload_optimizer`` on ``nvme`` need its ``async_io``
op, which ``ds_report`` marks incompatible where libaio is not installed (this machine). Their
"model state" is device + host bytes (on CPU both are RAM); files are not counted.

Two times per step, each the slower rank's: wall seconds, and the process CPU seconds (every
thread: gloo's, the param reader's) of the step, which a loaded machine inflates much less.

A step: zero-grad, forward + backward of one micro-batch per rank, grad sync, clipping at 1.0,
AdamW, param sync. Peers: ``deepspeed.initialize`` with ``zero_optimization.stage`` 2 / 3 and
``gradient_clipping`` 1.0 (torch AdamW as a client optimizer); torch FSDP2 (``fully_shard`` of
every transformer layer, then the root) with ``clip_grad_norm_`` and AdamW.

``--volume``: bytes each rank sends per step, counted at the collectives (p2p sends exactly; an
all-reduce as a ring's 2 (d-1)/d of its buffer), for megalite DDP and ZeRO-3: theory 1.5x.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from bench_cpu_adam import use_prebuilt_deepspeed_op  # noqa: E402

from megalite.core.distributed import ParamOffloadSpec, wrapper_class  # noqa: E402
from megalite.core.optimizer import OffloadSpec, build_optimizer  # noqa: E402
from megalite.core.optimizer.memory_report import model_state_bytes  # noqa: E402
from megalite.core.parallel_state import ParallelState  # noqa: E402
from megalite.models import GPTConfig, GPTModel  # noqa: E402
from megalite.training.components import gpt_units  # noqa: E402

DP = 2
LR, WD, CLIP = 1e-4, 0.01, 1.0
FILES_HOST_BYTES = 64 << 20  # the host buffers of each file stream (params, optimizer)
# kind: (strategy, optimizer offload: None | "host" | "disk", param offload: None | host | disk)
MEGALITE = {
    "ddp": ("no_shard", None, None),
    "zero1": ("optim", None, None),
    "zero2": ("optim_grads", None, None),
    "zero3": ("optim_grads_params", None, None),
    "zero2-offload": ("optim_grads", "host", None),
    "zero3-offload": ("optim_grads_params", "host", None),
    "zero3-infinity-cpu": ("optim_grads_params", "host", "host"),
    "zero3-infinity-nvme": ("optim_grads_params", "disk", "disk"),
}
PEERS = (
    "fsdp2",
    "deepspeed-zero2",
    "deepspeed-zero3",
    "deepspeed-zero3-offload",
    "deepspeed-zero3-offload-cpuadam",
)


def offload_specs(
    optim: str | None, param: str | None, directory: str
) -> tuple[OffloadSpec | None, ParamOffloadSpec | None]:
    """The optimizer's and the params' offload of a megalite kind (files under ``directory``)."""
    rank = dist.get_rank()
    opt = None if optim is None else OffloadSpec(fraction=1.0)
    if optim == "disk":
        opt = OffloadSpec(directory=f"{directory}/optim{rank}", host_bytes=FILES_HOST_BYTES)
    par = None if param is None else ParamOffloadSpec()
    if param == "disk":
        par = ParamOffloadSpec(directory=f"{directory}/param{rank}", host_bytes=FILES_HOST_BYTES)
    return opt, par


def config(args) -> GPTConfig:
    return GPTConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.hidden // 64,
        vocab_size=args.vocab,
        seq_length=args.seq,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_fused_kernels=False,
    )


def build(kind: str, cfg: GPTConfig, args):
    """(forward+backward+step closure, model-state bytes or None, end of run: delete the offload
    files or None) for ``kind`` on this rank."""
    torch.manual_seed(0)
    module = GPTModel(cfg, ParallelState.single()).train()
    g = torch.Generator().manual_seed(dist.get_rank())
    tokens = torch.randint(0, cfg.vocab_size, (args.micro_batch, cfg.seq_length), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (args.micro_batch, cfg.seq_length), generator=g)
    if kind in MEGALITE:
        strategy, optim_place, param_place = MEGALITE[kind]
        offload, param_offload = offload_specs(optim_place, param_place, args.offload_dir)
        extra = {}
        if strategy == "optim_grads_params":
            units, extras = gpt_units(module)
            extra = {"units": units, "unit_extras": extras, "param_offload": param_offload}
            extra["grad_offload"] = offload is not None
        model = wrapper_class(strategy)(
            module, dp_group=dist.group.WORLD, bucket_size=args.bucket, **extra
        )
        opt = build_optimizer(model, lr=LR, weight_decay=WD, clip_grad=CLIP, offload=offload)

        def step() -> None:
            model.zero_grad_buffer()
            opt.zero_grad()
            model(tokens, None, labels=labels).mean().backward()
            model.finish_grad_sync()
            opt.step()

        def remove_files() -> None:
            model.remove_offload_files()
            opt.remove_offload_files()

        files = remove_files if strategy == "optim_grads_params" else None
        return step, lambda: model_state_bytes(model, opt, dp_size=DP), files
    if kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (DP,))
        for layer in module.decoder.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(module, mesh=mesh)
        opt = torch.optim.AdamW(module.parameters(), lr=LR, weight_decay=WD)

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            module(tokens, None, labels=labels).mean().backward()
            torch.nn.utils.clip_grad_norm_(module.parameters(), CLIP)
            opt.step()

        return step, None, None
    import deepspeed

    stage = 3 if kind.startswith("deepspeed-zero3") else 2
    zero = {"stage": stage, "reduce_bucket_size": args.bucket}
    optimizer = torch.optim.AdamW(module.parameters(), lr=LR, weight_decay=WD)
    if kind.startswith("deepspeed-zero3-offload"):  # ZeRO-Infinity on the CPU
        zero.update(offload_param={"device": "cpu"}, offload_optimizer={"device": "cpu"})
    if kind == "deepspeed-zero3-offload-cpuadam":  # DeepSpeed's C++ CPU Adam (AdamW mode)
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        use_prebuilt_deepspeed_op()
        optimizer = DeepSpeedCPUAdam(module.parameters(), lr=LR, weight_decay=WD, adamw_mode=True)
    engine, *_ = deepspeed.initialize(
        model=module,
        optimizer=optimizer,
        config={
            "train_micro_batch_size_per_gpu": args.micro_batch,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": CLIP,
            "zero_optimization": zero,
            "zero_allow_untested_optimizer": True,
            "zero_force_ds_cpu_optimizer": False,
            "steps_per_print": 10**9,
        },
    )

    def step() -> None:
        loss = engine(tokens, None, labels=labels).mean()
        engine.backward(loss)
        engine.step()

    return step, None, None


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def timed(step) -> tuple[float, float]:
    """(wall s, process CPU s) of one step, each the slower rank's."""
    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    step()
    t = torch.tensor([time.perf_counter() - start, time.process_time() - cpu], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0]), float(t[1])


def run_kind(kind: str, args) -> tuple:
    """``(kind, median step s, peak RSS growth, model-state bytes or None, median step CPU s)`` on
    this rank."""
    cfg = config(args)
    base = _rss()
    step, state_bytes, remove_files = build(kind, cfg, args)
    if not args.tiny:  # warm-up: lazy optimizer state, allocator, gloo buffers
        step()
    times = [timed(step) for _ in range(args.steps)]
    wall, cpu = (statistics.median(t[i] for t in times) for i in (0, 1))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    s = state_bytes() if state_bytes else None
    state = None if s is None else s.total + s.host + s.params_host + s.grads_host
    if remove_files is not None:
        remove_files()
    return kind, wall, peak, state, cpu


# --- communication volume -------------------------------------------------------------------------


def run_volume(kind: str, args) -> tuple:
    sent = [0]
    real_batch, real_all_reduce = dist.batch_isend_irecv, dist.all_reduce

    def batch(ops):
        for op in ops:
            if op.op is dist.isend:
                sent[0] += op.tensor.numel() * op.tensor.element_size()
        return real_batch(ops)

    def all_reduce(tensor, *a, **k):
        d = dist.get_world_size(k.get("group"))
        if d > 1 and tensor.numel() > 1:  # a ring: 2 (d-1)/d of the buffer leaves each rank
            sent[0] += 2 * (d - 1) * tensor.numel() * tensor.element_size() // d
        return real_all_reduce(tensor, *a, **k)

    dist.batch_isend_irecv, dist.all_reduce = batch, all_reduce
    step, _, remove_files = build(kind, config(args), args)
    step()
    sent[0] = 0
    step()
    dist.batch_isend_irecv, dist.all_reduce = real_batch, real_all_reduce
    if remove_files is not None:
        remove_files()
    return kind, sent[0]


def worker(rank: int, init_file: str, fn, kinds: list[str], args, out_file: str) -> None:
    """Run ``fn(kind, args)`` for each of ``kinds`` in this world; rank 0 writes the results.

    The results go to a file, not a ``multiprocessing`` queue: a queue's feeder is a daemon
    thread, and a thread that holds tensors or the GIL when the interpreter shuts down aborts the
    process (``terminate called without an active exception``). Each set-up's model, optimizer
    and their references to the group die inside ``fn``; the barrier holds both ranks until every
    collective is done, so the group is destroyed with nothing in flight and no thread left.
    """
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getppid() % 1000))
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(DP), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=DP)
    try:
        results = [fn(kind, args) for kind in kinds]
        gc.collect()  # the set-ups' reference cycles (hooks) go now, not at interpreter exit
        dist.barrier()
        if rank == 0:
            with open(out_file, "w") as f:
                json.dump(results, f)
    finally:
        dist.destroy_process_group()


def spawn(fn, kinds: list[str], args) -> list:
    """``fn``'s results for ``kinds``, run one after the other in one fresh 2-process world."""
    with tempfile.TemporaryDirectory() as tmp:
        out_file = os.path.join(tmp, "results.json")
        argv = (os.path.join(tmp, "rdv"), fn, kinds, args, out_file)
        mp.spawn(worker, args=argv, nprocs=DP)
        with open(out_file) as f:
            return [tuple(r) for r in json.load(f)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--bucket", type=int, default=4_000_000, help="grad bucket (elements)")
    p.add_argument("--volume", action="store_true")
    p.add_argument("--tiny", action="store_true", help="2 layers, hidden 64: a smoke run")
    p.add_argument("--kinds", default=None, help="comma-separated subset")
    p.add_argument(
        "--offload-dir",
        default=os.path.join(tempfile.gettempdir(), "megalite-bench-offload"),
        help="the files of zero3-infinity-nvme",
    )
    args = p.parse_args()
    if args.tiny:
        args.layers, args.hidden, args.vocab, args.seq, args.rounds, args.steps = (
            2,
            64,
            128,
            16,
            1,
            1,
        )
    if args.volume:
        vol = dict(spawn(run_volume, ["ddp", "zero3"], args))
        print(
            f"bytes sent per rank per step: DDP {vol['ddp'] / 2**20:.2f} MiB, ZeRO-3 "
            f"{vol['zero3'] / 2**20:.2f} MiB, ratio {vol['zero3'] / vol['ddp']:.3f} "
            "(theory 1.5)"
        )
        return
    kinds = list(MEGALITE) + list(PEERS)
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        kinds = [k for k in kinds if not k.startswith("deepspeed")]
        print("DeepSpeed not importable: its rows are skipped (see the usage)")
    if args.kinds:
        kinds = [k for k in kinds if k in args.kinds.split(",")]
    else:  # DeepSpeed builds its CPU Adam op at first use where no prebuilt one is cached (about
        # 35 min here): asked for by name
        kinds = [k for k in kinds if k != "deepspeed-zero3-offload-cpuadam"]
    results = {k: [] for k in kinds}
    for _ in range(args.rounds):
        if args.tiny:  # a smoke run: every set-up in one world (its RSS column is not its own)
            for r in spawn(run_kind, kinds, args):
                results[r[0]].append(r)
            continue
        for k in kinds:
            results[k].append(spawn(run_kind, [k], args)[0])
    shape = f"GPT {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, seq {args.seq}"
    print(f"{shape}, micro-batch {args.micro_batch}; DP={DP} gloo; medians of {args.rounds} rounds")
    med = {k: statistics.median(r[1] for r in v) for k, v in results.items()}
    cpu = {k: statistics.median(r[4] for r in v) for k, v in results.items()}
    peers = ("deepspeed-zero2", "deepspeed-zero3", "deepspeed-zero3-offload")
    peers += ("deepspeed-zero3-offload-cpuadam",)
    for k, v in results.items():
        rss = statistics.median(r[2] for r in v) / 2**20
        state = v[0][3]
        state_txt = f"{state / 2**20:8.1f}" if state is not None else "       -"
        ratio = " ".join(
            f"{med[k] / med[b]:.2f}x ({cpu[k] / cpu[b]:.2f}x cpu) {b}" for b in peers if b in med
        )
        print(
            f"  {k:16s} step {med[k] * 1000:8.1f} ms (cpu {cpu[k] * 1000:7.1f} ms)  model state "
            f"{state_txt} MiB  peak RSS growth {rss:8.1f} MiB  {ratio}"
        )


if __name__ == "__main__":
    main()

"""ZeRO-1 at DP=2 on CPU/gloo: whole-step time and optimizer memory against two baselines.

    python tools/bench/bench_zero.py [--rounds 5] [--steps 3] [--layers 10] [--hidden 512]
    python tools/bench/bench_zero.py --collectives      # why the gloo collectives are p2p/broadcast
    python tools/bench/bench_zero.py [--collectives] --tiny   # seconds: 2 layers of h 64, 1 round

(The whole ladder, ZeRO-2/3 and offload beside DeepSpeed and FSDP2, and ZeRO-3's communication
volume: ``tools/bench/bench_zero_ladder.py``.)

Three set-ups of the same ~50M-parameter GPT-2 (megalite's ``GPTModel``, fp32, seed-identical) on
two gloo ranks, one thread each, alternating in one run (round-robin cancels this shared machine's
drift):

- ``megalite-zero1``: ``Zero1DataParallel`` + ``ShardedOptimizer`` (reduce-scatter, sharded
  AdamW over this rank's half, all-gather of the params);
- ``torch-zero``: ``torch.nn.parallel.DistributedDataParallel`` (bucketed all-reduce overlapped
  with backward) + ``torch.distributed.optim.ZeroRedundancyOptimizer(AdamW)`` (each rank steps the
  parameters it owns, then broadcasts them);
- ``megalite-zero1-overlap``: the same with ``overlap_grad_reduce`` (each bucket's reduce-scatter
  starts in backward) and ``overlap_param_gather`` (all-gathers wait for the next forward);
- ``megalite-plain``: megalite's all-reduce ``DistributedDataParallel`` + AdamW on every param.

A step is zero-grad + forward + backward + grad sync + global-norm clipping at 1.0 + AdamW + param
sync, on one micro-batch per rank; its time is the slower rank's. Reported: the median step time of
each, and ratios to ``torch-zero`` (target <= 1.0) and to ``megalite-plain``. Memory: optimizer
bytes per rank (fp32 masters that are not the params themselves + Adam states, over distinct
storages), ZeRO-1 vs plain (target 1/DP).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from megalite.core.distributed import DistributedDataParallel, Zero1DataParallel  # noqa: E402
from megalite.core.distributed.shard_collectives import (  # noqa: E402
    all_gather_shard,
    reduce_scatter_shard,
)
from megalite.core.groups import all_gather_tensor, reduce_scatter_tensor  # noqa: E402
from megalite.core.optimizer import (  # noqa: E402
    build_optimizer,
    build_sharded_optimizer,
    get_param_groups,
)
from megalite.core.optimizer.memory_report import model_state_bytes  # noqa: E402
from megalite.core.parallel_state import ParallelState  # noqa: E402
from megalite.models import GPTConfig, GPTModel  # noqa: E402

DP = 2
LR, WD, CLIP = 1e-4, 0.01, 1.0
KINDS = ("megalite-zero1", "megalite-zero1-overlap", "torch-zero", "megalite-plain")


def config(layers: int, hidden: int, seq: int, vocab: int) -> GPTConfig:
    return GPTConfig(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=hidden // 64,
        vocab_size=vocab,
        seq_length=seq,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_fused_kernels=False,
    )


def build(kind: str, cfg: GPTConfig, bucket: int):
    """(model, step_optimizer(), optimizer bytes fn) for one set-up on this rank."""
    module = GPTModel(cfg, ParallelState.single()).train()
    if kind.startswith("megalite-zero1"):
        overlap = kind.endswith("overlap")
        model = Zero1DataParallel(
            module,
            dp_group=dist.group.WORLD,
            bucket_size=bucket,
            overlap_grad_reduce=overlap,
            overlap_param_gather=overlap,
        )
        opt = build_sharded_optimizer(model, lr=LR, weight_decay=WD, clip_grad=CLIP)
    elif kind == "megalite-plain":
        model = DistributedDataParallel(module, dp_group=dist.group.WORLD, bucket_size=bucket)
        opt = build_optimizer(model, lr=LR, weight_decay=WD, clip_grad=CLIP)
    else:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel as TorchDDP

        model = TorchDDP(module, bucket_cap_mb=bucket * 4 / 2**20)
        opt = ZeroRedundancyOptimizer(
            get_param_groups(module, weight_decay=WD),
            optimizer_class=torch.optim.AdamW,
            lr=LR,
            weight_decay=WD,
        )
    return model, opt


def make_step(kind: str, model, opt, cfg: GPTConfig, micro_batch: int):
    g = torch.Generator().manual_seed(dist.get_rank())
    tokens = torch.randint(0, cfg.vocab_size, (micro_batch, cfg.seq_length), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (micro_batch, cfg.seq_length), generator=g)

    def step() -> None:
        if kind == "torch-zero":
            opt.zero_grad(set_to_none=True)
            model(tokens, None, labels=labels).mean().backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            return
        model.zero_grad_buffer()
        opt.zero_grad()
        model(tokens, None, labels=labels).mean().backward()
        model.finish_grad_sync()
        opt.step()

    return step


def optimizer_bytes(kind: str, model, opt) -> int:
    if kind == "torch-zero":
        seen = {}
        for state in opt.optim.state.values():
            for v in state.values():
                if torch.is_tensor(v):
                    seen[v.untyped_storage().data_ptr()] = v.untyped_storage().nbytes()
        return sum(seen.values())
    s = model_state_bytes(model, opt, dp_size=DP)
    return s.master + s.optimizer


def timed(step) -> float:
    dist.barrier()
    start = time.perf_counter()
    step()
    t = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slower rank's time
    return float(t.item())


def bench_steps(args) -> None:
    cfg = config(args.layers, args.hidden, args.seq, args.vocab)
    setups = {k: build(k, cfg, args.bucket) for k in KINDS}
    steps = {k: make_step(k, *setups[k], cfg, args.micro_batch) for k in KINDS}
    if not args.tiny:  # warm-up: lazy optimizer state, allocator, gloo buffers
        for k in KINDS:
            steps[k]()
    times = {k: [] for k in KINDS}
    for _ in range(args.rounds):
        for _ in range(args.steps):
            for k in KINDS:  # interleaved step by step: load changes hit all three alike
                times[k].append(timed(steps[k]))
    memory = {k: optimizer_bytes(k, *setups[k]) for k in KINDS}
    if dist.get_rank() != 0:
        return
    n_params = sum(p.numel() for p in setups["megalite-plain"][0].parameters())
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"model: {n_params / 1e6:.1f}M params, micro-batch {args.micro_batch} x seq {args.seq}")
    print(f"DP={DP} gloo, {args.rounds} rounds x {args.steps} steps each, medians:")
    for k in KINDS:
        print(f"  {k:15s} step {med[k] * 1000:8.1f} ms   optimizer {memory[k] / 2**20:8.1f} MiB")
    for k in ("megalite-zero1", "megalite-zero1-overlap"):
        for base in ("torch-zero", "megalite-plain"):
            print(f"time ratio {k} / {base} = {med[k] / med[base]:.3f}")
    ratio = memory["megalite-zero1"] / memory["megalite-plain"]
    print(f"optimizer memory zero1 / plain = {ratio:.3f}")


def bench_collectives(args) -> None:
    """Gloo's primitives on one buffer of ``--coll-numel`` fp32 elements, medians of rounds."""
    n = args.coll_numel
    data = torch.randn(n)
    shard = torch.empty(n // DP)
    ops = {
        "all_reduce": lambda: dist.all_reduce(data),
        "reduce_scatter_tensor": lambda: reduce_scatter_tensor(shard, data, None),
        "exchange reduce-scatter": lambda: reduce_scatter_shard(data, dist.group.WORLD),
        "all_gather_tensor": lambda: all_gather_tensor(data, shard, None),
        "exchange all-gather": lambda: all_gather_shard(data, dist.group.WORLD),
    }
    times = {k: [] for k in ops}
    for _ in range(args.rounds):
        for k, op in ops.items():
            times[k].append(timed(op))
    if dist.get_rank() == 0:
        base = statistics.median(times["all_reduce"])
        print(f"gloo, DP={DP}, {n / 1e6:.0f}M fp32 elements, medians of {args.rounds}:")
        for k, v in times.items():
            med = statistics.median(v)
            print(f"  {k:24s} {med * 1000:8.1f} ms   ratio to all_reduce {med / base:.2f}")


def worker(rank: int, init_file: str, args) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=DP)
    try:
        (bench_collectives if args.collectives else bench_steps)(args)
    finally:
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--layers", type=int, default=10)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--bucket", type=int, default=10_000_000, help="grad bucket (elements)")
    p.add_argument("--collectives", action="store_true")
    p.add_argument("--coll-numel", type=int, default=20_000_000)
    p.add_argument("--tiny", action="store_true", help="a smoke run: 2 layers of h 64, 1 round")
    args = p.parse_args()
    if args.tiny:
        args.rounds, args.steps, args.layers, args.hidden = 1, 1, 2, 64
        args.seq, args.vocab, args.coll_numel = 16, 128, 20_000
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(os.path.join(tmp, "rendezvous"), args), nprocs=DP)


if __name__ == "__main__":
    main()

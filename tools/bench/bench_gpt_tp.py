"""One GPT training step at TP2 (2 gloo processes, CPU): megalite's GPTModel vs the plain PyTorch
model of bench_gpt_step.py parallelised with ``torch.distributed.tensor.parallel``.

    python tools/bench/bench_gpt_tp.py [--rounds 7] [--steps 3] [--dropout 0.1]
    python tools/bench/bench_gpt_tp.py --tiny       # seconds: 2 layers of h 64, one round

The DTensor peer uses PyTorch's documented recipe on a ``DeviceMesh("cpu", [0, 1])``: per block
``qkv`` and ``fc1`` ``ColwiseParallel``, ``proj`` and ``fc2`` ``RowwiseParallel``; the token
embedding ``RowwiseParallel(input_layouts=Replicate())`` (vocab-sharded), the LM head
``ColwiseParallel(output_layouts=Shard(-1))`` with ``loss_parallel()`` (vocab-parallel cross
entropy, no logits gather). megalite: the same split (QKV and fc1 column-, proj and fc2
row-parallel, vocab-parallel embedding, output layer and cross entropy), no sequence parallel.
Embeddings are untied in both (parallelize_module shards the two uses of a tied weight separately).
Step: zero_grad, forward, mean loss, backward, ``torch.optim.AdamW.step()``; one intra-op thread per
process (two processes on this two-core machine). The two alternate in rounds; rank 0's median step
time is reported. Target: megalite / DTensor <= 1.0.
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

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from bench_gpt_step import BATCH, TINY, PlainGPT, bench_config  # noqa: E402

from megalite.core.parallel_state import initialize_model_parallel  # noqa: E402
from megalite.core.tensor_parallel.random import model_parallel_seed  # noqa: E402
from megalite.models import GPTModel  # noqa: E402

TP = 2


def build_dtensor(config):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(config.seed)
    model = PlainGPT(config)
    mesh = init_device_mesh("cpu", (TP,))
    plan = {
        "wte": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }
    for i in range(config.num_layers):
        plan.update(
            {
                f"blocks.{i}.qkv": ColwiseParallel(),
                f"blocks.{i}.proj": RowwiseParallel(),
                f"blocks.{i}.fc1": ColwiseParallel(),
                f"blocks.{i}.fc2": RowwiseParallel(),
            }
        )
    return parallelize_module(model, mesh, plan)


def make_step(kind: str, model, config):
    from torch.distributed.tensor.parallel import loss_parallel

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (BATCH, config.seq_length), generator=g)
    labels = torch.randint(0, config.vocab_size, (BATCH, config.seq_length), generator=g)

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        if kind == "megalite":
            loss = model(tokens, None, labels).mean()
            loss.backward()
        else:
            with loss_parallel():
                loss = model(tokens, labels)
                loss.backward()
        opt.step()
        loss = loss.detach()
        return float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)

    return step


def worker(rank: int, init_file: str, args, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=TP)
    size = TINY if args.tiny else {}
    config = bench_config(args.dropout, untie_embeddings_and_output_weights=True, **size)
    ps = initialize_model_parallel(TP)
    tracker = model_parallel_seed(config.seed, tp_rank=ps.tp_rank, pp_rank=ps.pp_rank)
    steps = {
        "megalite": make_step("megalite", GPTModel(config, ps, rng_tracker=tracker), config),
        "dtensor": make_step("dtensor", build_dtensor(config), config),
    }
    warmup = 1 if args.tiny else 2  # untimed steps (their losses are printed)
    losses = {k: [step() for _ in range(warmup)] for k, step in steps.items()}
    samples: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(args.rounds):
        for kind, step in steps.items():
            for _ in range(args.steps):
                dist.barrier()
                t0 = time.perf_counter()
                step()
                dist.barrier()
                samples[kind].append(time.perf_counter() - t0)
    if rank == 0:
        results.put(({k: statistics.median(v) for k, v in samples.items()}, losses))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--tiny", action="store_true", help="a smoke run: 2 layers of h 64")
    args = parser.parse_args()
    if args.tiny:
        args.rounds, args.steps = 1, 1
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=worker, args=(r, init_file, args, results)) for r in range(TP)]
        for p in procs:
            p.start()
        times, losses = results.get()
        for p in procs:
            p.join()
    print(f"TP{TP} GPT-2 (untied) batch {BATCH}, dropout {args.dropout}, fp32, 1 thread/rank")
    for k in ("dtensor", "megalite"):
        first = ", ".join(f"{x:.4f}" for x in losses[k])
        print(f"  {k:9s} step {times[k] * 1e3:8.1f} ms (median)   first losses {first}")
    print(f"  megalite / DTensor time: {times['megalite'] / times['dtensor']:.3f}x (target <= 1.0)")


if __name__ == "__main__":
    main()

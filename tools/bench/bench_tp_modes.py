"""One GPT-2 training step under each tensor-parallel mode on the same world (gloo, CPU): step
time and per-rank peak memory of 2d / 2.5d / 3d against 1d with sequence parallel, in one run,
then what the planner predicts for the same modes on GPUs.

    python tools/bench/bench_tp_modes.py [--world 4|8] [--rounds 5] [--steps 2]
    python tools/bench/bench_tp_modes.py --tiny [--world 8]  # seconds: 2 layers of h 64, 1 step

World 4: 1d TP 4 + SP vs 2d TP 4 (2 x 2). World 8: 1d TP 8 + SP vs 2.5d TP 8 (depth 2 x 2 x 2)
and 3d TP 8 (2 x 2 x 2).
The same model and global micro-batch (4 sequences: 2.5d's 4 batch blocks hold one each) in every
mode; one intra-op thread per rank. Step: zero_grad, forward, mean loss, backward (1d + SP: the
sequence-parallel grads summed over TP), AdamW step; the
modes alternate in rounds and rank 0 reports the median. Peak memory: the most bytes of tensor
storage alive at once during one step (``measure.live_bytes.LivePeak``), the largest over ranks.
On CPU with gloo every collective is a memory copy through sockets, so the order of the modes
says little about a GPU cluster. The planner's lines (``megalite.planning.tp_modes``, pure
arithmetic, no run) give each mode's bytes sent per device for one layer's forward and backward
and its parameters per device, at the bench's shape and at a GPU-sized layer (h 8192, s 4096,
micro-batch 8, bf16), and the seconds of that layer's collectives on H100s: the world's GPUs in
one node, and spread over two nodes (the tensor group crossing the slower inter-node links).
1d's line is without sequence parallel: SP's all-gather and reduce-scatter move the all-reduce's
bytes.
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

from megalite.core.distributed.sp_grads import all_reduce_sequence_parallel_grads  # noqa: E402
from megalite.core.parallel_state import initialize_model_parallel  # noqa: E402
from megalite.measure.live_bytes import LivePeak  # noqa: E402
from megalite.models import GPTConfig, GPTModel  # noqa: E402
from megalite.planning.cluster import preset  # noqa: E402
from megalite.planning.tp_modes import (  # noqa: E402
    bytes_per_device,
    layer_comms,
    layer_param_elements,
)

MICRO_BATCH = 4
MODES = {  # world -> [(label, mode, tp, depth, sequence_parallel)]
    4: [("1d TP4 + SP", "1d", 4, 1, True), ("2d TP4 (2x2)", "2d", 4, 1, False)],
    8: [
        ("1d TP8 + SP", "1d", 8, 1, True),
        ("2.5d TP8 (2x2x2)", "2.5d", 8, 2, False),
        ("3d TP8 (2x2x2)", "3d", 8, 1, False),
    ],
}
# a GPU-sized layer for the planner's lines (module docstring)
GPU_LAYER = GPTConfig(
    num_layers=1, hidden_size=8192, num_attention_heads=64, seq_length=4096, vocab_size=32000
)
GPU_MICRO_BATCH, GPU_BYTES = 8, 2


def model_config(tiny: bool, sequence_parallel: bool) -> GPTConfig:
    size = dict(num_layers=2, hidden_size=64, seq_length=32) if tiny else {}
    size = {"num_layers": 4, "hidden_size": 256, "seq_length": 128, **size}
    return GPTConfig(
        num_attention_heads=8,
        vocab_size=1024,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        sequence_parallel=sequence_parallel,
        **size,
    )


def make_step(config: GPTConfig, ps):
    model = GPTModel(config, ps)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    shape = (MICRO_BATCH, config.seq_length)
    tokens = torch.randint(0, config.vocab_size, shape, generator=g)
    labels = torch.randint(0, config.vocab_size, shape, generator=g)

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = model(tokens, None, labels).mean()
        loss.backward()
        if config.sequence_parallel:  # the norms' grads from sequence shards, summed over TP
            all_reduce_sequence_parallel_grads(model.parameters(), ps.tp_group)
        opt.step()
        return float(loss.detach())

    return step


def planner_lines(world: int, bench: GPTConfig) -> list[str]:
    """Each mode's predicted bytes per device (one layer, forward and backward), parameters per
    device, and the seconds of the GPU layer's collectives on ``world`` H100s (module
    docstring)."""
    one_node = preset("H100", world, gpus_per_node=world)
    two_nodes = preset("H100", world, gpus_per_node=world // 2)
    lines = [
        f"planner, per device per layer: at the bench's shape (fp32) | a GPU layer h "
        f"{GPU_LAYER.hidden_size} s {GPU_LAYER.seq_length} micro-batch {GPU_MICRO_BATCH} bf16 on "
        f"{world} H100s: in one node / over two nodes of {world // 2}"
    ]
    for label, mode, tp, depth, _ in MODES[world]:
        fwd, bwd = layer_comms(
            bench, mode=mode, tp=tp, depth=depth, micro_batch_size=MICRO_BATCH, e=4
        )
        sent = bytes_per_device(fwd + bwd)
        params = layer_param_elements(bench, mode=mode, tp=tp, depth=depth)
        fwd, bwd = layer_comms(
            GPU_LAYER, mode=mode, tp=tp, depth=depth, micro_batch_size=GPU_MICRO_BATCH, e=GPU_BYTES
        )
        gpu_sent = bytes_per_device(fwd + bwd)
        seconds = [
            sum(c.collective_seconds(x.op, x.nbytes, x.n, x.span) * x.count for x in fwd + bwd)
            for c in (one_node, two_nodes)
        ]
        lines.append(
            f"  {label:18s} sends {sent / 2**20:6.2f} MiB, holds {params / 1e3:7.1f} k params | "
            f"sends {gpu_sent / 2**20:7.0f} MiB: {seconds[0] * 1e3:6.2f} / "
            f"{seconds[1] * 1e3:6.2f} ms"
        )
    return lines


def worker(rank: int, world: int, init_file: str, args, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    steps, states, out = {}, [], {}
    for label, mode, tp, depth, sp in MODES[world]:
        ps = initialize_model_parallel(tp, tensor_parallel_mode=mode, tensor_parallel_depth=depth)
        states.append(ps)
        steps[label] = make_step(model_config(args.tiny, sp), ps)
    for label, step in steps.items():
        losses = [] if args.tiny else [step()]  # warm up (a smoke run: none)
        with LivePeak() as live:
            losses.append(step())
        peaks = [None] * world
        dist.all_gather_object(peaks, live.peak)
        out[label] = {"losses": losses, "peak": max(peaks), "times": []}
    for _ in range(args.rounds):
        for label, step in steps.items():
            for _ in range(args.steps):
                dist.barrier()
                t0 = time.perf_counter()
                step()
                dist.barrier()
                out[label]["times"].append(time.perf_counter() - t0)
    if rank == 0:
        results.put(out)
    for ps in states:
        ps.destroy()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, choices=sorted(MODES), default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--tiny", action="store_true", help="a smoke run: h 64, one step")
    args = parser.parse_args()
    if args.tiny:
        args.rounds, args.steps = 1, 1
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(target=worker, args=(r, args.world, init_file, args, results))
            for r in range(args.world)
        ]
        for p in procs:
            p.start()
        out = results.get()
        for p in procs:
            p.join()
    c = model_config(args.tiny, False)
    print(
        f"world {args.world}: GPT-2 {c.num_layers} layers h {c.hidden_size} s {c.seq_length} "
        f"micro-batch {MICRO_BATCH}, fp32, 1 thread/rank"
    )
    base = None
    for label, r in out.items():
        t = statistics.median(r["times"])
        base = base or (t, r["peak"])
        first = ", ".join(f"{x:.4f}" for x in r["losses"])
        print(
            f"  {label:18s} step {t * 1e3:8.1f} ms ({t / base[0]:.2f}x)   peak "
            f"{r['peak'] / 2**20:7.2f} MiB ({r['peak'] / base[1]:.2f}x)   losses {first}"
        )
    for line in planner_lines(args.world, c):
        print(line)


if __name__ == "__main__":
    main()

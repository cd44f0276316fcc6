"""Tensor-parallel layer benchmarks (CPU).

    python tools/bench/bench_tp_layers.py [--repeats 7]
    python tools/bench/bench_tp_layers.py --tiny    # seconds: h 128, one repeat, TP 2 bytes only

1. Column + row parallel linear at TP=1, forward + backward, against two ``nn.Linear`` (the ratio is
   megalite / torch; target <= 1.05).
2. The bytes each TP MLP block (column -> GELU -> row) moves in forward + backward, counted at the
   collectives on 2 and 4 gloo ranks, beside the theory: without sequence parallel two all-reduces
   of b*s*h elements (one forward in the row layer, one backward in the column layer); with it an
   all-gather and a reduce-scatter of the same total in each direction.
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
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from megalite.core.parallel_state import initialize_model_parallel  # noqa: E402
from megalite.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear  # noqa: E402


def _time(fn, repeats: int, inner: int) -> float:
    fn()  # warm up
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - t0) / inner)
    return statistics.median(samples)


def bench_tp1(repeats: int, size: tuple[int, int, int] = (512, 4, 1024)) -> None:
    torch.manual_seed(0)
    s, b, h = size
    x = torch.randn(s, b, h, requires_grad=True)
    col = ColumnParallelLinear(h, 4 * h, tp_group=None)
    row = RowParallelLinear(4 * h, h, tp_group=None)
    fc1, fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def megalite_step():
        y, _ = col(x)
        y, _ = row(F.gelu(y))
        y.sum().backward()

    def torch_step():
        fc2(F.gelu(fc1(x))).sum().backward()

    ratios = []
    for _ in range(repeats):  # interleave, so drift in machine load hits both sides
        t_m = _time(megalite_step, 1, 3)
        t_t = _time(torch_step, 1, 3)
        ratios.append(t_m / t_t)
    t_m, t_t = _time(megalite_step, repeats, 3), _time(torch_step, repeats, 3)
    print(
        f"TP=1 column+row fwd+bwd [s={s}, b={b}, h={h}, ffn={4 * h}]: megalite {t_m * 1e3:.1f} ms, "
        f"nn.Linear {t_t * 1e3:.1f} ms, ratio (median of {repeats} interleaved) "
        f"{statistics.median(ratios):.3f}x (target <= 1.05)"
    )


def _count_bytes(rank: int, world: int, init_file: str, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    ps = initialize_model_parallel(world, 1)
    s, b, h = 64, 2, 32
    counted = {"bytes": 0, "calls": []}
    names = (
        "all_reduce",
        "all_gather_into_tensor",
        "all_gather_single",
        "reduce_scatter_single",
        "reduce_scatter_tensor",
    )
    real = {n: getattr(dist, n) for n in names if hasattr(dist, n)}

    def counting(name):
        def wrapped(*args, **kwargs):
            # wire bytes one rank sends in a ring algorithm: an all-reduce 2(n-1)/n of the full
            # tensor, an all-gather or a reduce-scatter (n-1)/n of the full tensor
            full = args[1] if name.startswith("reduce_scatter") else args[0]
            nbytes = full.numel() * full.element_size()
            factor = 2 if name == "all_reduce" else 1
            counted["bytes"] += factor * (world - 1) * nbytes // world
            counted["calls"].append(f"{name}({full.numel()})")
            return real[name](*args, **kwargs)

        return wrapped

    for name in real:
        setattr(dist, name, counting(name))
    out = {}
    for sp in (False, True):
        col = ColumnParallelLinear(h, 4 * h, tp_group=ps.tp_group, sequence_parallel=sp)
        row = RowParallelLinear(4 * h, h, tp_group=ps.tp_group, sequence_parallel=sp)
        x = torch.randn(s // world if sp else s, b, h, requires_grad=True)
        counted["bytes"], counted["calls"] = 0, []
        y, _ = col(x)
        y, _ = row(F.gelu(y))
        fwd, fwd_calls = counted["bytes"], list(counted["calls"])
        y.sum().backward()
        out[sp] = (fwd, counted["bytes"] - fwd, fwd_calls, counted["calls"][len(fwd_calls) :])
    for name, fn in real.items():
        setattr(dist, name, fn)
    if rank == 0:
        results.put((world, s * b * h * 4, out))
    dist.destroy_process_group()


def bench_bytes(worlds: tuple[int, ...] = (2, 4)) -> None:
    ctx = mp.get_context("spawn")
    for world in worlds:
        q = ctx.Queue()
        init_file = os.path.join(tempfile.mkdtemp(), "rdzv")
        procs = [
            ctx.Process(target=_count_bytes, args=(r, world, init_file, q)) for r in range(world)
        ]
        for p in procs:
            p.start()
        world, full, out = q.get(timeout=120)
        for p in procs:
            p.join()
        theory = 2 * (world - 1) * full // world  # one all-reduce of b*s*h per direction
        for sp, (fwd, bwd, fwd_calls, bwd_calls) in out.items():
            kind = "all-gather + reduce-scatter" if sp else "all-reduce"
            print(
                f"TP={world} MLP block, SP {'on ' if sp else 'off'}: "
                f"wire bytes/rank forward {fwd}, "
                f"backward {bwd}; theory {theory} each way ({kind} of b*s*h fp32, "
                f"2(n-1)/n x {full} B); measured/theory {fwd / theory:.2f} / {bwd / theory:.2f}; "
                f"calls fwd {fwd_calls} bwd {bwd_calls}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--tiny", action="store_true", help="a smoke run: small sizes, TP 2")
    args = parser.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    if args.tiny:
        bench_tp1(1, size=(64, 2, 128))
        bench_bytes((2,))
        return
    bench_tp1(args.repeats)
    bench_bytes()


if __name__ == "__main__":
    main()

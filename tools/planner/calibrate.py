"""``tools/plan.py --calibrate``: measure this machine and save the figures the planner uses.

- matmul throughput (``[n, n] x [n, n]`` in the training dtype) at a few sizes; the largest is
  the machine's ``peak_tflops`` on CPU (on a GPU the data sheet's peak stays, see below);
- attention throughput (``scaled_dot_product_attention``, causal);
- a reference training step of a small GPT in one process, at two micro-batch sizes: the model
  FLOPs over the time give the achieved rate, the two sizes split it into ``efficiency`` (of peak)
  and a fixed ``layer_overhead_s`` per layer per pass;
- the optimizer step's seconds per parameter;
- each collective's latency and bus bandwidth between two busy local processes on CPU
  (``calibrate_comm``: what a step meets); an all-reduce between two GPUs over NCCL;
- the offload links: host <-> device copies and NVMe reads and writes of a file in the
  calibration file's folder (``calibrate_offload``).

Medians of several repetitions. The file format is in ``planning.cluster``. Every collective
names its group: ``calibrate_comm.world_group()`` in the processes this module spawns, the
caller's in ``calibrate_in_world``.
"""

from __future__ import annotations

import functools
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megalite.core.parallel_state import ParallelState
from megalite.planning.cluster import save_calibration
from megalite.planning.model_state import param_numels
from megalite.training import flops
from megalite.training.arguments import parse_args
from megalite.training.config import with_tokenizer
from megalite.training.forward_step import make_forward_step
from megalite.training.pretrain import build_run
from tools.planner.calibrate_comm import busy_collectives, world_group
from tools.planner.calibrate_offload import offload_figures

REFERENCE = (
    "--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 128 "
    "--lr 1e-4 --train-iters 1000 --mock-data --tokenizer-type NullTokenizer --vocab-size 1024 "
    "--hidden-dropout 0 --attention-dropout 0 --log-interval 1000 --eval-iters 0"
).split()


def _median_time(fn: Callable[[], None], *, repeat: int, sync: Callable[[], None]) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _sync(device: torch.device) -> Callable[[], None]:
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def matmul_tflops(device: torch.device, dtype: torch.dtype, sizes=(256, 512, 1024)) -> dict:
    out = {}
    for n in sizes:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        t = _median_time(lambda a=a, b=b: a @ b, repeat=5, sync=_sync(device))
        out[str(n)] = 2 * n**3 / t / 1e12
    return out


def attention_tflops(device: torch.device, dtype: torch.dtype, *, s: int = 512) -> float:
    q, k, v = (torch.randn(1, 8, s, 64, device=device, dtype=dtype) for _ in range(3))
    t = _median_time(
        lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
        repeat=5,
        sync=_sync(device),
    )
    return 4 * 8 * s * s * 64 / t / 1e12


def reference_step(
    argv: list[str], device: torch.device, *, repeat: int = 5
) -> tuple[float, object]:
    """Median seconds of one training step of the model ``argv`` in one process, and its config."""
    cfg = with_tokenizer(parse_args(argv, env={}))
    run = build_run(cfg, ParallelState.single(device), device, seed_rng=True, resume=False)
    step = make_forward_step(device)
    t = _median_time(
        lambda: run.trainer.step(step, run.train_iter), repeat=repeat, sync=_sync(device)
    )
    return t, cfg


def _layers(argv: list[str], n: int) -> list[str]:
    out = list(argv)
    if "--num-layers" in out:
        out[out.index("--num-layers") + 1] = str(n)
    else:
        out += ["--num-layers", str(n)]
    return out


def fit_compute(
    argv: list[str],
    device: torch.device,
    *,
    peak_tflops: float,
    optimizer_s_per_param: float,
    repeat: int = 5,
) -> dict[str, float]:
    """``efficiency``, ``layer_overhead_s``, ``chunk_overhead_s`` and ``step_overhead_s`` from four
    steps: micro-batch 1 and 4 in one micro-batch (their difference is FLOPs: the rate); 4
    micro-batches of 1 (the FLOPs of micro-batch 4: the difference is 3 micro-batches' fixed
    cost); the same with half the layers (what the fixed cost per micro-batch loses with them is
    per layer, spread 1 : 2 over forward and backward; the rest is per pass of the chunk, half
    each way); what is left of the first step, less the optimizer step, is the step's own fixed
    cost (zeroing the grads, the loss, the grad norm)."""
    layers = parse_layers(argv)
    points = []
    for b, gbs, n in ((1, 1, layers), (4, 4, layers), (1, 4, layers), (1, 4, layers // 2)):
        batch = ["--micro-batch-size", str(b), "--global-batch-size", str(gbs)]
        t, cfg = reference_step([*_layers(argv, n), *batch], device, repeat=repeat)
        m = cfg.model
        model_flops = flops.model_flops_per_iteration(
            num_layers=m.num_layers,
            hidden_size=m.hidden_size,
            seq_length=m.seq_length,
            global_batch_size=gbs,
            padded_vocab_size=m.padded_vocab_size(1),
            ffn_hidden_size=m.ffn_hidden_size,
            num_attention_heads=m.num_attention_heads,
            kv_channels=m.kv_channels,
            num_query_groups=m.num_query_groups,
            swiglu=m.swiglu,
        )
        params = sum(k for _, k in param_numels(m, tp=1, pp=1, pp_rank=0))
        points.append((model_flops, t, params))
    (f1, t1, params), (f4, t4, _), (_, t4m, _), (fh, th, params_h) = points
    rate = (f4 - f1) / max(t4 - t1, 1e-9)  # FLOP/s of the marginal work
    per_microbatch = max((t4m - t4) / 3, 0.0)
    fixed = max(t1 - f1 / rate - per_microbatch - params * optimizer_s_per_param, 0.0)
    half = (th - fixed - fh / rate - params_h * optimizer_s_per_param) / 4
    per_layer = max((per_microbatch - half) / (layers - layers // 2), 0.0)
    per_layer = min(per_layer, per_microbatch / layers)
    return {
        "efficiency": rate / (peak_tflops * 1e12),
        "layer_overhead_s": per_layer / 3,
        "chunk_overhead_s": (per_microbatch - layers * per_layer) / 2,
        "step_overhead_s": fixed,
    }


def parse_layers(argv: list[str]) -> int:
    return int(argv[argv.index("--num-layers") + 1]) if "--num-layers" in argv else 2


def _busy_seconds(n: int = 40) -> float:
    a, b = torch.randn(192, 192), torch.randn(192, 192)
    a @ b
    start = time.perf_counter()
    for _ in range(n):
        a @ b
    return time.perf_counter() - start


def shared_cores(group: dist.ProcessGroup, *, repeat: int = 3) -> float:
    """The cores the ranks of ``group`` (CPU, gloo) share: each rank computes alone (the others
    wait in a barrier, asleep) and then all at once; ``world x alone / together`` (medians),
    ``world`` when they do not slow each other down. Collective over ``group``."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    alone, together = [], []
    for _ in range(repeat):
        for r in range(world):
            dist.barrier(group=group)
            if r == rank:
                alone.append(_busy_seconds())
        dist.barrier(group=group)
        together.append(_busy_seconds())
    mine = torch.tensor([statistics.median(alone), statistics.median(together)])
    dist.all_reduce(mine, group=group)
    cores = world * float(mine[0] / mine[1])
    return world if cores > 0.9 * world else max(cores, 1.0)


def calibrate_in_world(
    argv: list[str] = REFERENCE,
    *,
    group: dist.ProcessGroup,
    peak_tflops: float = 1.0,
    repeat: int = 3,
    quick: bool = False,
) -> dict:
    """The calibration of a CPU gloo ``group``, in it (every rank of it calls this): the shared
    cores, then the reference steps with every rank busy (``fit_compute``: each rank alone on its
    model), the figures scaled back to a rank with a core of its own; each collective between
    busy ranks, over ``group`` (``calibrate_comm.busy_collectives``). ``quick``: one round of each
    measurement and short collective loops (a smoke run's figures: the code runs, the numbers are
    rough)."""
    device = torch.device("cpu")
    world = dist.get_world_size(group)
    repeat = 1 if quick else repeat
    cores = shared_cores(group, repeat=repeat)
    slow = world / cores
    opt = optimizer_seconds_per_param(device, n=100_000 if quick else 1_000_000)
    dist.barrier(group=group)
    fit = fit_compute(
        argv, device, peak_tflops=peak_tflops, optimizer_s_per_param=opt, repeat=repeat
    )
    names = ("efficiency", "layer_overhead_s", "chunk_overhead_s", "step_overhead_s")
    figures = torch.tensor([*(fit[k] for k in names), opt], dtype=torch.float64)
    dist.all_reduce(figures, group=group)
    eff, layer, chunk, step, opt = (figures / world).tolist()
    # every rank the same figures (and so the same predictions)
    collectives = (
        busy_collectives(group, iterations=4, repeat=1) if quick else busy_collectives(group)
    )
    return {
        "device": "cpu",
        "peak_tflops": peak_tflops,
        "cores": cores if cores < world else 0,
        "efficiency": eff * slow,
        "layer_overhead_s": layer / slow,
        "chunk_overhead_s": chunk / slow,
        "step_overhead_s": step / slow,
        "optimizer_s_per_param": opt / slow,
        "collectives": collectives,
    }


def optimizer_seconds_per_param(device: torch.device, n: int = 4_000_000) -> float:
    p = torch.nn.Parameter(torch.randn(n, device=device))
    p.grad = torch.randn(n, device=device)
    opt = torch.optim.AdamW([p], lr=1e-4)
    return _median_time(opt.step, repeat=5, sync=_sync(device)) / n


def _all_reduce_worker(
    rank: int, world: int, init_file: str, queue, *, backend: str, sizes
) -> None:
    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    group = world_group()
    out = {}
    for n in sizes:
        x = torch.ones(n // 4, device=device)
        reduce = functools.partial(dist.all_reduce, x, group=group)
        out[n] = _median_time(reduce, repeat=7, sync=_sync(device))
    if rank == 0:
        queue.put(out)
    dist.destroy_process_group()


def _busy_worker(rank: int, world: int, init_file: str, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    figures = busy_collectives(world_group())
    if rank == 0:
        queue.put(figures)
    dist.destroy_process_group()


def _in_world(worker, world: int = 2):
    """What rank 0 of a spawned ``world``-process gloo group puts in the queue."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "init")
        procs = [ctx.Process(target=worker, args=(r, world, init, queue)) for r in range(world)]
        for p in procs:
            p.start()
        out = queue.get(timeout=300)
        for p in procs:
            p.join()
    return out


def all_reduce_figures(backend: str, *, sizes=(1 << 12, 1 << 16, 1 << 20, 1 << 23)) -> dict:
    """Latency (s) and bus bandwidth (GB/s) of a 2-rank all-reduce: ``t = lat + bytes / bw``
    (for two ranks the bus factor 2 (n-1)/n is 1)."""
    times = _in_world(functools.partial(_all_reduce_worker, backend=backend, sizes=sizes))
    small, large = min(sizes), max(sizes)
    bw = (large - small) / max(times[large] - times[small], 1e-9)
    return {
        "latency_s": max(times[small] - small / bw, 0.0),
        "gbps": bw / 1e9,
        "seconds": {str(k): v for k, v in times.items()},
    }


def calibrate(
    *, device: torch.device | None = None, argv: list[str] = REFERENCE, directory: str = "."
) -> dict:
    """Every figure, as the calibration file holds them; the disk's measured in ``directory``."""
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    mm = matmul_tflops(device, dtype, sizes=(1024, 4096, 8192) if cuda else (256, 512, 1024))
    peak = (flops.peak_tflops(name, "bf16") if cuda else None) or max(mm.values())
    data = {
        "device": name,
        "peak_tflops": peak,
        "matmul_tflops": mm,
        "attention_tflops": attention_tflops(device, dtype),
        "optimizer_s_per_param": optimizer_seconds_per_param(device),
        "cores": 0 if cuda else os.cpu_count() or 0,
    }
    ref = argv if not cuda else [*argv, "--bf16"]
    data.update(
        fit_compute(
            ref, device, peak_tflops=peak, optimizer_s_per_param=data["optimizer_s_per_param"]
        )
    )
    if not cuda:  # each op between busy ranks, as a CPU step meets it (calibrate_comm)
        data["collectives"] = _in_world(_busy_worker)
    elif torch.cuda.device_count() >= 2:
        data["collectives"] = {"all_reduce": all_reduce_figures("nccl")}
    else:
        data["collectives"] = {}  # one GPU: keep the cluster's link figures
    data.update(offload_figures(directory, device=device))
    return data


def calibrate_and_save(path: str, *, out) -> dict:
    data = calibrate(directory=os.path.dirname(os.path.abspath(path)))
    save_calibration(path, data)
    print(
        f"calibrated {data['device']}: peak {data['peak_tflops']:.3g} TFLOP/s, efficiency "
        f"{data['efficiency']:.2f}, layer overhead {data['layer_overhead_s'] * 1e6:.0f} us, "
        f"all-reduce {data['collectives'].get('all_reduce', {}).get('gbps', float('nan')):.2f} "
        f"GB/s, host copies {data['host_gbps']:.1f} GB/s, disk read {data['disk_read_gbps']:.2f} "
        f"/ write {data['disk_write_gbps']:.2f} GB/s -> {path}",
        file=out,
    )
    return data

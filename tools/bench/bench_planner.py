r"""The planner against measurement on this CPU: step time per layout, and the ranking.

    cpu-run python tools/bench/bench_planner.py         # calibrate, then 6 layouts on 2 ranks
    cpu-run python tools/bench/bench_planner.py --calibration calib.json --steps 7
    python tools/bench/bench_planner.py --tiny          # seconds: a smoke run

Calibrates this machine (``planning.calibrate``; or reads ``--calibration``), predicts the step
time of each candidate layout of one model on a 2-rank gloo world (DP with each ZeRO rung, TP with
and without SP, PP with each schedule), then runs each layout for ``--steps`` steps and takes the
median (the slowest rank's time per step). Prints predicted vs measured per layout, and whether
the layout the planner ranks first is within 10% of the measured best (the issue's bar).
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megalite.planning.calibrate import (  # noqa: E402
    REFERENCE,
    calibrate,
    fit_compute,
    optimizer_seconds_per_param,
)
from megalite.planning.cluster import Cluster, calibrated, load_calibration  # noqa: E402
from megalite.planning.predict import Layout  # noqa: E402
from megalite.planning.search import evaluate  # noqa: E402

WORLD = 2
PEAK = 1.0  # TFLOP/s: on CPU the efficiency is then the achieved rate itself
MODEL = [a for a in REFERENCE if a not in ("--vocab-size", "1024")]
VOCAB = 1024
LAYOUTS = [
    Layout(dp=2, micro_batch_size=4),
    Layout(dp=2, micro_batch_size=4, rung="optim"),
    Layout(tp=2, micro_batch_size=4),
    Layout(tp=2, micro_batch_size=8, sequence_parallel=True),
    Layout(pp=2, micro_batch_size=2),
    Layout(pp=2, micro_batch_size=2, schedule="gpipe"),
]


def _worker(
    rank: int, init: str, argvs: list[list[str]], steps: int, queue, reference: list[str]
) -> None:
    from megalite.core.parallel_state import initialize_model_parallel
    from megalite.training.arguments import parse_args
    from megalite.training.config import with_tokenizer
    from megalite.training.forward_step import make_forward_step
    from megalite.training.pretrain import build_run

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=WORLD)
    env = {"WORLD_SIZE": str(WORLD), "RANK": str(rank)}
    # compute calibration with every rank busy, as in the layouts: ranks share this CPU's cores
    device = torch.device("cpu")
    opt = optimizer_seconds_per_param(device)
    dist.barrier()
    fit = fit_compute(reference, device, peak_tflops=PEAK, optimizer_s_per_param=opt)
    calibration = {**fit, "optimizer_s_per_param": opt}
    out = []
    for argv in argvs:
        cfg = with_tokenizer(parse_args(argv, env=env))
        par = cfg.parallel
        ps = initialize_model_parallel(
            par.tensor_model_parallel_size, par.pipeline_model_parallel_size
        )
        run = build_run(cfg, ps, torch.device("cpu"), seed_rng=True, resume=False)
        step = make_forward_step(torch.device("cpu"))
        times = []
        for i in range(steps + 1):
            dist.barrier()
            start = time.perf_counter()
            run.trainer.step(step, run.train_iter)
            t = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if i:  # the first step allocates the Adam states
                times.append(t.item())
        out.append(statistics.median(times))
        ps.destroy()
    if rank == 0:
        queue.put((calibration, out))
    dist.destroy_process_group()


def measure(argvs: list[list[str]], steps: int, reference: list[str]) -> tuple[dict, list]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "init")
        procs = [
            ctx.Process(target=_worker, args=(r, init, argvs, steps, queue, reference))
            for r in range(WORLD)
        ]
        for p in procs:
            p.start()
        while True:  # a rank that dies leaves nothing in the queue: stop instead of waiting
            try:
                result = queue.get(timeout=5)
                break
            except Exception:
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise SystemExit("error: a measuring rank failed (traceback above)") from None
        for p in procs:
            p.join()
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calibration", help="a file of tools/plan.py --calibrate (default: measure)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--tiny", action="store_true", help="smoke run: 2 layouts, 1 step")
    p.add_argument("--global-batch-size", type=int, default=8)
    args = p.parse_args(argv)
    model, layouts = list(MODEL), LAYOUTS
    if args.tiny:
        model = [*model, "--num-layers", "2", "--hidden-size", "64", "--seq-length", "32"]
        layouts, args.steps = LAYOUTS[:2], 1
    reference = [*model, "--vocab-size", str(VOCAB)]
    data = load_calibration(args.calibration) if args.calibration else calibrate(argv=reference)
    base = Cluster(gpus=WORLD, gpus_per_node=WORLD, gpu_memory_gib=64, peak_tflops=PEAK,
                   intra_node_gbps=1.0, inter_node_gbps=1.0, device="cpu", name="cpu")  # fmt: skip
    gbs = args.global_batch_size
    argvs = []
    for lay in layouts:
        c = evaluate(model, lay, base, vocab_size=VOCAB, global_batch_size=gbs)
        if c.error:
            raise SystemExit(f"error: {lay.name()}: {c.error}")
        argvs.append([*c.argv, "--train-iters", str(args.steps + 2)])  # data for every step
    concurrent, measured = measure(argvs, args.steps, reference)
    # links from the calibration; compute and optimizer from the run with every rank busy
    cluster = calibrated(base, {**data, "peak_tflops": PEAK, **concurrent})
    cands = [
        evaluate(model, lay, cluster, vocab_size=VOCAB, global_batch_size=gbs) for lay in layouts
    ]
    print(
        f"calibration: efficiency {cluster.efficiency:.2f} of {cluster.peak_tflops:.3g} TFLOP/s, "
        f"layer overhead {cluster.layer_overhead_s * 1e6:.0f} us, all-reduce "
        f"{cluster.intra_node_gbps:.2f} GB/s + {cluster.collective_latency_s * 1e6:.0f} us"
    )
    print(f"{'layout':<36} {'predicted s':>12} {'measured s':>11} {'error':>8}")
    errors = []
    for c, t in zip(cands, measured):
        err = c.step.seconds / t - 1
        errors.append(abs(err))
        print(f"{c.layout.name():<36} {c.step.seconds:>12.4f} {t:>11.4f} {err:>+8.1%}")
    best_pred = min(range(len(cands)), key=lambda i: cands[i].step.seconds)
    best_meas = min(measured)
    ratio = measured[best_pred] / best_meas
    print(
        f"median |error| {statistics.median(errors):.1%}, max {max(errors):.1%}; predicted best "
        f"{cands[best_pred].layout.name()} runs {ratio:.3f}x the measured best "
        f"({'within' if ratio <= 1.10 else 'NOT within'} 10%)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

r"""The planner's step time against measurement on this CPU, per layout, and the ranking.

    cpu-run-all python tools/bench/bench_planner.py              # 2 ranks, every feature
    cpu-run-all python tools/bench/bench_planner.py --world 4 --steps 5
    cpu-run-all python tools/bench/bench_planner.py --small --repeats 3   # the suite's old bars
    python tools/bench/bench_planner.py --tiny                   # seconds: a smoke run

Spawns a gloo world of ``--world`` ranks which calibrates itself
(``tools/planner/calibrate.py``, ``calibrate_in_world``: the cores its ranks share, the compute
rate and fixed costs with every rank busy, the all-reduce), then predicts and runs each layout
(``tools/planner/accuracy.py``): DP with each ZeRO rung, TP with and
without SP, PP with each schedule, recompute, CP, EP. Prints predicted vs measured (medians of
``--steps`` steps, the slowest rank's) and whether the layout the planner ranks first is within 10%
of the measured best (the planner's ranking bar).

``--repeats N`` measures every layout N times (each time calibrated afresh) and prints, per layout,
the median error and its [min, max] over the repetitions: the noise of this machine beside the
model's error. The bars the test suite once asserted on these timings are reported here: every
layout's median error within 20% ("outside 20%" names the others) and, per repetition, the
predicted best within 10% of the measured best. The suite itself checks the planner against the
counted work of real steps (``tests/planning/test_step_time.py``), which no machine's load moves.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megalite.planning.predict import Layout  # noqa: E402
from tools.planner.accuracy import step_time_accuracy  # noqa: E402
from tools.planner.calibrate import REFERENCE  # noqa: E402

MODEL = [a for a in REFERENCE if a not in ("--vocab-size", "1024")]
VOCAB = 1024
SMALL = ["--num-layers", "4", "--hidden-size", "128", "--seq-length", "64"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2"]


def layouts(world: int) -> list:
    w = world
    out = [Layout(dp=w, micro_batch_size=8 // w)]
    for rung in ("optim", "optim_grads", "optim_grads_params"):
        out.append(Layout(dp=w, micro_batch_size=8 // w, rung=rung))
    out += [Layout(tp=w, micro_batch_size=4)]
    out += [Layout(tp=w, micro_batch_size=4, sequence_parallel=True)]
    schedules = [("1f1b", 1), ("gpipe", 1), ("interleaved-1f1b", 2), ("zb-h1", 1)]
    schedules += [("zbv", 2), ("dualpipev", 2)]
    for sched, vp in schedules:
        out.append(Layout(pp=w, micro_batch_size=1, schedule=sched, vp=vp))
    out += [
        Layout(dp=w, micro_batch_size=8 // w, recompute="full"),
        Layout(tp=w, micro_batch_size=4, recompute="selective"),
        Layout(cp=w, micro_batch_size=4),
        (Layout(dp=w, ep=w, micro_batch_size=8 // w), MOE),
    ]
    return out


def _worker(rank: int, world: int, init: str, args, queue) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    model, items = list(MODEL), layouts(world)
    if world > 2:  # two layers per stage: every V / interleaved schedule has chunks to split
        model[model.index("--num-layers") + 1] = str(2 * world)
    if args.small:
        model += SMALL
    if args.tiny:
        model += ["--num-layers", "2", "--hidden-size", "64", "--seq-length", "32"]
        items = items[:2]
    reference = [*model, "--vocab-size", str(VOCAB)]
    tables = []
    for _ in range(args.repeats):
        calib, rows = step_time_accuracy(
            model,
            items,
            vocab_size=VOCAB,
            global_batch_size=8,
            steps=args.steps,
            reference=reference,
            recalibrate=args.recalibrate,
            quick_calibration=args.tiny,
        )
        tables.append(
            [(r.layout.name(), r.predicted, r.measured, r.raw_error, r.error) for r in rows]
        )
    if rank == 0:
        queue.put((calib, tables))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--small", action="store_true", help="the suite's model (4 layers, h 128)")
    p.add_argument("--recalibrate", action="store_true", help="calibrate before each layout")
    p.add_argument("--repeats", type=int, default=3, help="measure every layout N times")
    p.add_argument("--tiny", action="store_true", help="smoke run: 2 layouts, 1 step")
    args = p.parse_args(argv)
    if args.tiny:
        args.steps, args.repeats = 1, 1
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "init")
        procs = [
            ctx.Process(target=_worker, args=(r, args.world, init, args, queue), daemon=True)
            for r in range(args.world)
        ]
        for proc in procs:
            proc.start()
        while True:  # a rank that dies leaves nothing in the queue: stop instead of waiting
            try:
                calib, tables = queue.get(timeout=5)
                break
            except Exception:
                if any(proc.exitcode not in (None, 0) for proc in procs):
                    raise SystemExit("error: a measuring rank failed (traceback above)") from None
        for proc in procs:
            proc.join()
    collectives = ", ".join(
        f"{op} {v['latency_s'] * 1e3:.2f} ms ({v.get('idle_latency_s', 0) * 1e3:.2f} "
        f"in step) + {v['gbps']:.2f} GB/s"
        for op, v in calib["collectives"].items()
    )
    print(
        f"calibration: cores {calib['cores'] or args.world:g}, rate {calib['efficiency']:.3g} "
        f"TFLOP/s, layer overhead {calib['layer_overhead_s'] * 1e6:.0f} us, chunk overhead "
        f"{calib.get('chunk_overhead_s', 0) * 1e6:.0f} us, step overhead "
        f"{calib['step_overhead_s'] * 1e3:.1f} ms; between busy ranks: {collectives}"
    )
    print(
        f"{'layout':<40} {'predicted s':>12} {'measured s':>11} {'raw':>8} {'error':>8}"
        f"  [min, max] of {len(tables)}"
    )
    errors, outside = [], []
    for i, (name, pred, *_) in enumerate(tables[0]):
        meas = statistics.median(t[i][2] for t in tables)
        raw = statistics.median(t[i][3] for t in tables)
        errs = [t[i][4] for t in tables]
        err = statistics.median(errs)
        errors.append(abs(err))
        if abs(err) > 0.20:
            outside.append(name)
        print(
            f"{name:<40} {pred:>12.4f} {meas:>11.4f} {raw:>+8.1%} {err:>+8.1%}"
            f"  [{min(errs):+.1%}, {max(errs):+.1%}]"
        )
    print(
        f"median |error| {statistics.median(errors):.1%}, max {max(errors):.1%}; outside 20%: "
        f"{', '.join(outside) or 'none'}"
    )
    for k, rows in enumerate(tables):
        best = min(range(len(rows)), key=lambda i: rows[i][1])
        ratio = rows[best][2] / min(r[2] for r in rows)
        print(
            f"repetition {k + 1}: predicted best {rows[best][0]} runs {ratio:.3f}x the measured "
            f"best ({'within' if ratio <= 1.10 else 'NOT within'} 10%)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

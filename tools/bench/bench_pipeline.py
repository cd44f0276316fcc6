"""Pipeline schedule benchmark on CPU/gloo: megalite's schedules vs torch.distributed.pipelining
and vs megalite's own 1F1B, and the simulator's prediction vs the measurement.

    python tools/bench/bench_pipeline.py --all [--pp 4] [--m 8] [--steps 5] [--timeline-dir DIR]
    python tools/bench/bench_pipeline.py [--steps 7] [--timeline-dir DIR]   # 1F1B / GPipe only
    python tools/bench/bench_pipeline.py [--all] --tiny      # seconds: PP 2, m 2 and 4, one step

``--all``: every schedule (1f1b, gpipe, interleaved-1f1b v2, zb-h1, zbv, dualpipev) at PP ``--pp``
and ``--m`` micro-batches on a stack of 8 MLP blocks (megalite's column/row-parallel linears, so
the weight grads really defer), medians of ``--steps`` steps; torch's class of the same name where
it has one (ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble,
ScheduleDualPipeV; its error is printed when it cannot run); per schedule the MEASURED step over
megalite's 1F1B step beside the simulator's PREDICTED one (F / I / W of every stage profiled alone
in the same run, p2p, executor time and the cores the ranks really share: see
``bench_pipeline_all.py``), and the prediction with one core per rank (a GPU cluster). With
``--timeline-dir`` it writes each schedule's measured and predicted timelines as SVG.

One process per stage (2 stages by default, one core each), the same compute-bound stack of residual
MLP blocks on every side, the same micro-batches. Prints per-step medians and the ratio megalite /
torch (target <= 1.0 for 1F1B), then the measured bubble fraction of megalite's 1F1B beside the
theory ``(pp - 1) / (m + pp - 1)`` for several m. With ``--timeline-dir`` it writes the per-stage
spans of
one 1F1B and one GPipe step as JSON and SVG (see tools/pipeline_timeline.py).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from megalite.core.pipeline_parallel.forward_backward import (  # noqa: E402
    forward_backward_pipelining_1f1b,
    forward_backward_pipelining_gpipe,
)
from megalite.core.pipeline_parallel.model_chunk import ModelChunk  # noqa: E402
from megalite.core.pipeline_parallel.p2p import P2PCommunicator  # noqa: E402
from megalite.core.pipeline_parallel.timeline import Timeline  # noqa: E402
from tools.bench.bench_pipeline_all import (  # noqa: E402
    SMOKE_HIDDEN,
    SMOKE_MICRO_BATCH,
    process_context,
    run_all,
    timed_pair,
)
from tools.pipeline_timeline import render_svg  # noqa: E402

HIDDEN, BLOCKS_PER_STAGE, MICRO_BATCH = 512, 4, 64


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(HIDDEN, 4 * HIDDEN), nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class Stack(nn.Module):
    """The stage's layers; ``set_input_tensor`` for megalite's schedules."""

    def __init__(self, is_first):
        super().__init__()
        self.blocks = nn.Sequential(*[Block() for _ in range(BLOCKS_PER_STAGE)])
        self.is_first, self.input_tensor = is_first, None

    def set_input_tensor(self, t):
        self.input_tensor = t

    def forward(self, x):
        return self.blocks(x)


@functools.lru_cache(maxsize=8)
def _data(m):
    """The step's inputs and targets, made once (outside every timed step, as for torch's)."""
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(m * MICRO_BATCH, HIDDEN, generator=g),
        torch.randn(m * MICRO_BATCH, HIDDEN, generator=g),
    )


_COMMUNICATORS: dict = {}


def _communicator(rank, pp):
    """One communicator per run, as in training (its neighbour check runs once)."""
    if rank not in _COMMUNICATORS:
        _COMMUNICATORS[rank] = P2PCommunicator(
            prev_rank=rank - 1 if rank > 0 else None,
            next_rank=rank + 1 if rank < pp - 1 else None,
            tensor_shape=(MICRO_BATCH, HIDDEN),
            dtype=torch.float32,
            device=torch.device("cpu"),
            group=dist.group.WORLD,  # the bench runs one pipeline over the whole world
        )
    return _COMMUNICATORS[rank]


def _megalite_step(stack, schedule, m, rank, pp, timeline=None):
    x, y = _data(m)
    xs, ys = x.chunk(m), y.chunk(m)
    batches = iter(range(m))

    def forward_step(it, model):
        i = next(it)
        out = model(xs[i] if model.is_first else model.input_tensor)
        return out, lambda o: (torch.nn.functional.mse_loss(o, ys[i]), {})

    p2p = _communicator(rank, pp)
    fn = (
        forward_backward_pipelining_1f1b
        if schedule == "1f1b"
        else forward_backward_pipelining_gpipe
    )
    fn(
        forward_step_func=forward_step,
        data_iterator=[batches],
        model=[ModelChunk(stack)],
        num_microbatches=m,
        p2p=p2p,
        pp_rank=rank,
        pp_size=pp,
        timeline=timeline,
    )


def _torch_schedule(stack, schedule, m, rank, pp):
    # torch >= 2.4 (megalite runs from 2.2): imported only where the comparison runs
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    stage = PipelineStage(stack.blocks, rank, pp, torch.device("cpu"))
    cls = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
    sched = cls(stage, n_microbatches=m, loss_fn=torch.nn.functional.mse_loss)
    x, y = _data(m)

    def step():
        if rank == 0:
            sched.step(x)
        elif rank == pp - 1:
            sched.step(target=y, losses=[])
        else:
            sched.step()

    return step


def _worker(rank, pp, init_file, args, results):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=pp)
    torch.manual_seed(rank)
    stack = Stack(is_first=rank == 0)
    out = {}
    for m in args.microbatches:
        for schedule in ("1f1b", "gpipe"):
            # torch's schedules refuse fewer micro-batches than stages
            theirs = _torch_schedule(stack, schedule, m, rank, pp) if m >= pp else None
            out[(m, schedule)] = timed_pair(
                lambda s=schedule, n=m: _megalite_step(stack, s, n, rank, pp),
                theirs,
                args.steps,
                [stack],
            )
        # bubble: idle share of the step on each stage, from recorded spans
        tl = Timeline()
        dist.barrier()
        t0 = time.perf_counter()
        _megalite_step(stack, "1f1b", m, rank, pp, timeline=tl)
        dist.barrier()
        step_time = time.perf_counter() - t0
        busy = torch.tensor([tl.busy_seconds() / step_time])
        dist.all_reduce(busy)
        out[(m, "bubble")] = 1 - busy.item() / pp
    if args.timeline_dir:
        for schedule in ("1f1b", "gpipe"):
            tl = Timeline()
            dist.barrier()
            base = time.perf_counter()
            _megalite_step(stack, schedule, 8, rank, pp, timeline=tl)
            spans = [[label, s - base, e - base] for label, s, e in tl.spans]
            gathered = [None] * pp
            dist.all_gather_object(gathered, spans)
            if rank == 0:
                os.makedirs(args.timeline_dir, exist_ok=True)
                path = os.path.join(args.timeline_dir, f"timeline_{schedule}.json")
                with open(path, "w") as f:
                    json.dump({"stages": gathered}, f)
    if rank == 0:
        results.put(out)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all", action="store_true", help="every schedule at --pp / --m")
    parser.add_argument("--m", type=int, default=8)
    parser.add_argument("--pp", type=int, default=None)
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[8, 1, 2, 4, 16])
    parser.add_argument("--timeline-dir", default=None)
    parser.add_argument(
        "--check",
        action="store_true",
        help="with --all: exit 1 unless every predicted / measured step lies within 15%%",
    )
    parser.add_argument("--tiny", action="store_true", help="a smoke run: PP 2, m 2 and 4, 1 step")
    args = parser.parse_args()
    if args.tiny:
        args.pp, args.m, args.steps, args.microbatches = args.pp or 2, 4, 1, [2, 4]
    if args.all:
        ratios = run_all(
            pp=args.pp or 4,
            m=args.m,
            steps=args.steps,
            timeline_dir=args.timeline_dir,
            quick=args.tiny,
        )
        bad = {k: round(r, 3) for k, r in ratios.items() if abs(r - 1) > 0.15}
        if args.check and bad:
            raise SystemExit(f"predicted / measured outside [0.85, 1.15]: {bad}")
        return
    args.pp = args.pp or 2
    ctx = process_context(args.tiny)
    if args.tiny:  # the forked ranks inherit these: a smoke run's shapes are small
        global HIDDEN, MICRO_BATCH
        HIDDEN, MICRO_BATCH = SMOKE_HIDDEN, SMOKE_MICRO_BATCH
    q = ctx.Queue()
    init_file = os.path.join(tempfile.mkdtemp(), "rdzv")
    procs = [
        ctx.Process(target=_worker, args=(r, args.pp, init_file, args, q)) for r in range(args.pp)
    ]
    for p in procs:
        p.start()
    while True:  # wait for rank 0's results, but notice a worker that died
        try:
            out = q.get(timeout=5)
            break
        except Exception:  # noqa: BLE001 - queue.Empty
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                for p in procs:
                    p.kill()
                raise SystemExit(f"a benchmark worker failed (exit codes {dead})") from None
    for p in procs:
        p.join()
    pp = args.pp
    print(
        f"pp={pp}, {BLOCKS_PER_STAGE} MLP blocks of h={HIDDEN} per stage, micro-batch {MICRO_BATCH}"
    )
    for m in args.microbatches:
        for schedule in ("1f1b", "gpipe"):
            ours, theirs = out[(m, schedule)]
            if theirs is None:
                print(
                    f"  m={m:2d} {schedule:5s}: megalite {ours * 1e3:7.1f} ms, torch.distributed."
                    f"pipelining refuses m < pp"
                )
                continue
            print(
                f"  m={m:2d} {schedule:5s}: megalite {ours * 1e3:7.1f} ms, torch.distributed."
                f"pipelining {theirs * 1e3:7.1f} ms, ratio {ours / theirs:.3f}x"
            )
        ours_1f1b, ours_gpipe = out[(m, "1f1b")][0], out[(m, "gpipe")][0]
        print(f"         megalite 1F1B / megalite GPipe: {ours_1f1b / ours_gpipe:.3f}x")
    print("bubble fraction of megalite 1F1B (idle share of the step, mean over stages):")
    for m in sorted(args.microbatches):
        theory = (pp - 1) / (m + pp - 1)
        print(f"  m={m:2d}: measured {out[(m, 'bubble')]:.3f}, theory {theory:.3f}")
    if args.timeline_dir:
        for schedule in ("1f1b", "gpipe"):
            base = os.path.join(args.timeline_dir, f"timeline_{schedule}")
            with open(base + ".json") as f:
                stages = json.load(f)["stages"]
            with open(base + ".svg", "w") as f:
                f.write(render_svg(stages, f"megalite {schedule.upper()}, pp={pp}, m=8"))
            print(f"wrote {base}.svg")


if __name__ == "__main__":
    main()

"""``bench_pipeline.py --all``: every megalite schedule at PP p, m micro-batches, on CPU/gloo.

One process per pipeline rank, one thread each. Prints per schedule: megalite's median step, the
ratio to megalite's 1F1B, torch.distributed.pipelining's class of the same name (or why it cannot
run), and the simulator's predicted step (F / I / W times profiled from one ZB-H1 step, p2p from
the same step's receive waits being ignored: given as 0) with predicted / measured.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from megalite.core.pipeline_parallel.actions import with_p2p
from megalite.core.pipeline_parallel.generators import generate, layout_of
from megalite.core.pipeline_parallel.p2p import P2PCommunicator
from megalite.core.pipeline_parallel.schedules import forward_backward_pipelining
from megalite.core.pipeline_parallel.simulator import Costs, simulate
from megalite.core.pipeline_parallel.timeline import Timeline
from megalite.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

HIDDEN, BLOCKS, MICRO_BATCH = 256, 8, 32
CASES = [("1f1b", 1), ("gpipe", 1), ("interleaved-1f1b", 2), ("zb-h1", 1), ("zbv", 2),
         ("dualpipev", 2)]  # fmt: skip
TORCH_CLASS = {"1f1b": "Schedule1F1B", "gpipe": "ScheduleGPipe",
               "interleaved-1f1b": "ScheduleInterleaved1F1B",
               "zb-h1": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble",
               "dualpipev": "ScheduleDualPipeV"}  # fmt: skip


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = ColumnParallelLinear(HIDDEN, 4 * HIDDEN, tp_group=None)
        self.fc2 = RowParallelLinear(4 * HIDDEN, HIDDEN, tp_group=None)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)[0]))[0]


class Chunk(nn.Module):
    def __init__(self, n, first):
        super().__init__()
        self.blocks = nn.Sequential(*[Block() for _ in range(n)])
        self.first, self.input_tensor = first, None

    def set_input_tensor(self, t):
        self.input_tensor = t

    def forward(self, x):
        return self.blocks(x if self.first else self.input_tensor)


def _data(m):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(m, MICRO_BATCH, HIDDEN, generator=g),
            torch.randn(m, MICRO_BATCH, HIDDEN, generator=g))  # fmt: skip


def _megalite(schedule, v, chunks, p2p, m, rank, pp, timeline=None):
    xs, ys = _data(m)

    def forward_step(it, model):
        i = next(it)
        out = model(xs[i])
        return out, lambda o: (torch.nn.functional.mse_loss(o, ys[i]), {})

    its = [iter(range(m)) for _ in chunks]
    forward_backward_pipelining(
        schedule=schedule, forward_step_func=forward_step, data_iterator=its, model=chunks,
        num_microbatches=m, p2p=p2p, pp_rank=rank, pp_size=pp, timeline=timeline,
    )  # fmt: skip


def _torch_step(schedule, v, chunks, m, rank, pp):
    import torch.distributed.pipelining as tp

    layout = layout_of(schedule, pp, v)
    stages = [
        tp.PipelineStage(c.blocks, layout.stage(rank, k), layout.num_stages, torch.device("cpu"))
        for k, c in enumerate(chunks)
    ]
    cls = getattr(tp, TORCH_CLASS[schedule])
    loss = torch.nn.functional.mse_loss
    single = issubclass(cls, tp.schedules.PipelineScheduleSingle)  # else it takes a list of stages
    sched = cls(stages[0] if single else stages, n_microbatches=m, loss_fn=loss)
    x, y = _data(m)
    x, y = x.reshape(m * MICRO_BATCH, HIDDEN), y.reshape(m * MICRO_BATCH, HIDDEN)
    has_first = any(layout.stage(rank, k) == 0 for k in range(len(chunks)))
    has_last = any(layout.stage(rank, k) == layout.num_stages - 1 for k in range(len(chunks)))

    def step():
        kwargs = {}
        if has_last:
            kwargs = {"target": y, "losses": []}
        sched.step(x, **kwargs) if has_first else sched.step(**kwargs)

    return step


def _timed(step, steps, chunks):
    samples = []
    for i in range(steps + 1):
        for c in chunks:
            c.zero_grad(set_to_none=True)
        dist.barrier()
        t0 = time.perf_counter()
        step()
        dist.barrier()
        if i:
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _worker(rank, pp, m, steps, init_file, timeline_dir, q):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=pp)
    out = {}
    profile = None
    for schedule, v in CASES:
        torch.manual_seed(rank)
        layout = layout_of(schedule, pp, v)
        n = BLOCKS // layout.num_stages
        chunks = [Chunk(n, layout.stage(rank, c) == 0) for c in range(layout.num_chunks)]
        p2p = P2PCommunicator(
            prev_rank=rank - 1 if rank else None, next_rank=rank + 1 if rank < pp - 1 else None,
            tensor_shape=(MICRO_BATCH, HIDDEN), dtype=torch.float32, device=torch.device("cpu"),
            group=dist.group.WORLD, pp_ranks=list(range(pp)),
        )  # fmt: skip
        args = (schedule, v, chunks, p2p, m, rank, pp)
        ours = _timed(lambda a=args: _megalite(*a), steps, chunks)
        try:
            step = _torch_step(schedule, v, chunks, m, rank, pp)
            theirs = _timed(step, steps, chunks)
        except Exception as e:  # noqa: BLE001 - reported: why torch's class cannot run here
            theirs = f"{type(e).__name__}: {str(e).splitlines()[0][:150]}"
            dist.barrier()
        tl = Timeline()
        dist.barrier()
        base = time.perf_counter()
        _megalite(schedule, v, chunks, p2p, m, rank, pp, timeline=tl)
        spans = [[label, s - base, e - base] for label, s, e in tl.spans]
        gathered = [None] * pp
        dist.all_gather_object(gathered, spans)
        if schedule == "zb-h1":
            profile = gathered
        out[schedule] = (ours, theirs, gathered)
    if rank == 0:
        q.put((out, profile))
    dist.destroy_process_group()
    del timeline_dir


def _costs(profile) -> Costs:
    """Mean F / I / W of one ZB-H1 step (one chunk = one stage), over all ranks."""
    times = {"forward": [], "backward-input": [], "backward-weight": []}
    for spans in profile:
        for label, s, e in spans:
            kind = label.split()[0]
            if kind in times:
                times[kind].append(e - s)
    mean = {k: statistics.mean(v) for k, v in times.items()}
    return Costs(mean["forward"], mean["backward-input"], mean["backward-weight"], p2p=0.0)


def run_all(*, pp: int, m: int, steps: int, timeline_dir: str | None) -> dict[str, float]:
    """Run and print every schedule; returns predicted / measured per schedule."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    init_file = os.path.join(tempfile.mkdtemp(), "rdzv")
    procs = [ctx.Process(target=_worker, args=(r, pp, m, steps, init_file, timeline_dir, q))
             for r in range(pp)]  # fmt: skip
    for p in procs:
        p.start()
    out, profile = q.get(timeout=1800)
    for p in procs:
        p.join()
    stage = _costs(profile)
    print(
        f"pp={pp} m={m}, {BLOCKS} MLP blocks of h={HIDDEN}, micro-batch {MICRO_BATCH}, "
        f"medians of {steps} steps; profiled per stage F {stage.forward * 1e3:.2f} ms, I "
        f"{stage.backward_input * 1e3:.2f} ms, W {stage.backward_weight * 1e3:.2f} ms"
    )
    base = out["1f1b"][0]
    ratios = {}
    for schedule, v in CASES:
        ours, theirs, gathered = out[schedule]
        layout = layout_of(schedule, pp, v)
        scale = 1 / layout.num_chunks
        costs = Costs(stage.forward * scale, stage.backward_input * scale,
                      stage.backward_weight * scale, p2p=0.0)  # fmt: skip
        sim = simulate(with_p2p(generate(schedule, pp_size=pp, num_microbatches=m,
                                         num_chunks=v), layout), layout, costs)  # fmt: skip
        torch_part = (f"torch {TORCH_CLASS[schedule]} {theirs * 1e3:7.1f} ms, ratio "
                      f"{ours / theirs:.3f}x" if isinstance(theirs, float)
                      else f"torch {TORCH_CLASS[schedule]}: {theirs}")  # fmt: skip
        ratios[schedule] = sim.step_time / ours
        print(f"  {schedule:17s} megalite {ours * 1e3:7.1f} ms ({ours / base:.3f}x 1F1B), "
              f"predicted {sim.step_time * 1e3:7.1f} ms ({sim.step_time / ours:.2f}x measured, "
              f"bubble {sim.bubble:.3f}); {torch_part}")  # fmt: skip
        if timeline_dir:
            from tools.pipeline_timeline import render_svg

            os.makedirs(timeline_dir, exist_ok=True)
            for what, stages in (("measured", gathered), ("predicted", sim.spans)):
                path = os.path.join(timeline_dir, f"timeline_{schedule}_{what}.svg")
                with open(path, "w") as f:
                    f.write(render_svg(stages, f"megalite {schedule} ({what}), pp={pp}, m={m}"))
            with open(os.path.join(timeline_dir, f"timeline_{schedule}.json"), "w") as f:
                json.dump({"stages": gathered}, f)
    return ratios

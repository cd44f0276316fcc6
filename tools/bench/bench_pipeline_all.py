"""``bench_pipeline.py --all``: every megalite schedule at PP p, m micro-batches, on CPU/gloo.

One process per pipeline rank, one thread each. Prints per schedule: megalite's median step, the
ratio to megalite's 1F1B, torch.distributed.pipelining's class of the same name (or why it cannot
run), and the simulator's prediction from costs profiled in the same run:

- F / I / W of every global stage, every rank timing its chunks AT ONCE (``profile_chunks``: a
  rank's chunks in turn, each part's CPU time on the main thread: the caches and memory traffic
  of the run, not the time a rank waits for a shared core; one profile per stage count: 4 and 8
  stages at PP 4) and, for comparison, each rank timing them alone in turn (wall time), the p2p
  latency from a ping-pong, the executor's time per action (``executor_cpu_per_action``: the main
  thread's CPU time outside compute and receive waits in 1F1B steps, mean over ranks, and its parts:
  the backend's posting calls, the send waits, the timeline's bookkeeping, the executor's own; the
  same with a one-multiply model, whose caches stay warm, gives the executor's Python alone),
  the CPU the backend's threads spend per message in those steps (gloo moves the bytes on a
  socket loop thread of each end's process: ``Costs.transfer_cpu``), and the cores the ranks
  really get (every rank computing for one wall-clock window; PP 4 on a
  2-core machine shares them, and loses some of them to switching between its ranks);
- "predicted" replays each schedule's action list with those costs and that core sharing
  (``simulate(..., cores=c)``; with more ranks than cores, ``cores`` = the machine's and
  ``oversubscribed`` = the measured cores over the machine's: the speed a rank keeps of its
  share while more ranks than cores are runnable; each message's thread work then takes its
  share of the cores beside the ranks): its step over the predicted 1F1B step is
  printed beside the MEASURED step over the measured 1F1B step, so "faster than 1F1B by about
  what the simulator predicts" is checked on this machine;
- "one core per rank" replays the same lists with the same F / I / W and p2p but a core (a
  device) per rank and no executor time: the ratio to 1F1B a GPU cluster would see.
"""

from __future__ import annotations

import functools
import itertools
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
from megalite.core.pipeline_parallel.forward_backward import forward_backward_pipelining
from megalite.core.pipeline_parallel.generators import generate, layout_of
from megalite.core.pipeline_parallel.model_chunk import ModelChunk
from megalite.core.pipeline_parallel.p2p import P2PCommunicator
from megalite.core.pipeline_parallel.profiling import (
    ClockedP2P,
    executor_cpu_per_action,
    gather_stage_costs,
    p2p_latency,
    profile_chunk,
    profile_chunks,
)
from megalite.core.pipeline_parallel.simulator import Costs, simulate
from megalite.core.pipeline_parallel.timeline import LABELS, Timeline
from megalite.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from tools.pipeline_timeline import render_svg

HIDDEN, BLOCKS, MICRO_BATCH = 256, 8, 32
SMOKE_HIDDEN, SMOKE_MICRO_BATCH = 16, 4  # ``--tiny``: every schedule runs, nothing is timed
CASES = [
    ("1f1b", 1),
    ("gpipe", 1),
    ("interleaved-1f1b", 2),
    ("zb-h1", 1),
    ("zbv", 2),
    ("dualpipev", 2),
]
MESSAGES = ("SEND_F", "SEND_B", "RECV_F", "RECV_B")
TORCH_CLASS = {
    "1f1b": "Schedule1F1B",
    "gpipe": "ScheduleGPipe",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "zb-h1": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}


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


@functools.lru_cache(maxsize=4)
def _data(m):
    """The step's inputs and targets, made once (outside every timed step, as for torch's)."""
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(m, MICRO_BATCH, HIDDEN, generator=g),
        torch.randn(m, MICRO_BATCH, HIDDEN, generator=g),
    )


class OneParameter(nn.Module):
    """A stage that is one multiply (``x * w``): the executor's own work with its caches warm
    (no compute between its actions to evict them)."""

    def __init__(self, first):
        super().__init__()
        self.w = nn.Parameter(torch.ones(()))
        self.first, self.input_tensor = first, None

    def set_input_tensor(self, t):
        self.input_tensor = t

    def forward(self, x):
        return (x if self.first else self.input_tensor) * self.w


def _forward_step(it, model):
    x, y = next(it)
    out = model(x)
    return out, lambda o: (torch.nn.functional.mse_loss(o, y), {})


@functools.lru_cache(maxsize=4)
def _pairs(m):
    """The micro-batches as (input, target) pairs, made once: a step only iterates them."""
    xs, ys = _data(m)
    return tuple(zip(xs, ys))


def _wrapped(chunks) -> list[ModelChunk]:
    """The stage modules as the schedules take them, built once per model (as a trainer does),
    not in each timed step: the wrappers are the bench's work, not the executor's."""
    return [ModelChunk(chunk, index=c) for c, chunk in enumerate(chunks)]


def _megalite(schedule, v, model, p2p, m, rank, pp, timeline=None):
    """One step of megalite's ``schedule`` over ``model`` (``_wrapped`` chunks)."""
    pairs = _pairs(m)
    forward_backward_pipelining(
        schedule=schedule,
        forward_step_func=_forward_step,
        data_iterator=[iter(pairs) for _ in model],
        model=model,
        num_microbatches=m,
        p2p=p2p,
        pp_rank=rank,
        pp_size=pp,
        timeline=timeline,
    )


def _torch_step(schedule, v, chunks, m, rank, pp):
    # torch >= 2.4 (megalite runs from 2.2): imported only where the comparison runs
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


def _once(step, chunks) -> float:
    for c in chunks:
        c.zero_grad(set_to_none=True)
    dist.barrier()
    t0 = time.perf_counter()
    step()
    dist.barrier()
    return time.perf_counter() - t0


def timed_pair(ours, theirs, steps, chunks):
    """Median step of megalite's schedule and of torch's (``theirs``: None when it cannot run),
    their steps alternating (ours first in even rounds, theirs in odd ones), so that neither
    runs on a heap, caches or machine state the other left more often: run one after the other,
    the first schedule of a run paid for the process's warm-up alone."""
    samples: tuple[list[float], list[float]] = ([], [])
    steppers = (ours, theirs) if theirs is not None else (ours,)
    for step in steppers:  # warm-up: shape inference, allocations
        _once(step, chunks)
    for i in range(steps):
        order = list(enumerate(steppers))
        for k, step in order if i % 2 == 0 else order[::-1]:
            samples[k].append(_once(step, chunks))
    return tuple(statistics.median(x) if x else None for x in samples)


def _worker(rank, pp, m, steps, init_file, timeline_dir, q, quick=False):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=pp)
    out = {}
    profile = _profile_all(
        pp, m, rank, quick
    )  # before any step: fresh chunks, untouched by torch's
    for schedule, v in CASES:
        torch.manual_seed(rank)
        layout = layout_of(schedule, pp, v)
        n = BLOCKS // layout.num_stages
        chunks = [Chunk(n, layout.stage(rank, c) == 0) for c in range(layout.num_chunks)]
        p2p = P2PCommunicator(**_p2p_kwargs(rank, pp))
        model = _wrapped(chunks)
        args = (schedule, v, model, p2p, m, rank, pp)
        try:
            step = _torch_step(schedule, v, chunks, m, rank, pp)
            _once(step, chunks)  # torch's first step, where its class refuses what it cannot run
            failed = None
        except Exception as e:  # noqa: BLE001 - reported: why torch's class cannot run here
            step, failed = None, f"{type(e).__name__}: {str(e).splitlines()[0][:150]}"
            dist.barrier()
        ours, theirs = timed_pair(lambda a=args: _megalite(*a), step, steps, chunks)
        theirs = failed or theirs
        tl = Timeline()
        dist.barrier()
        base = time.perf_counter()
        _megalite(schedule, v, model, p2p, m, rank, pp, timeline=tl)
        end = time.perf_counter()
        spans = [[label, s - base, e - base] for label, s, e in tl.spans]
        gathered = [None] * pp
        dist.all_gather_object(gathered, (spans, end - base))
        out[schedule] = (ours, theirs, [g[0] for g in gathered], [g[1] for g in gathered])
        if schedule == "1f1b":  # the executor's CPU per action and its parts, mean over ranks
            repeats = 1 if quick else 3
            actions = with_p2p(generate(schedule, pp_size=pp, num_microbatches=m), layout)[rank]
            n, messages = len(actions), sum(a.op in MESSAGES for a in actions)
            clocked = ClockedP2P(**_p2p_kwargs(rank, pp))
            timed = (schedule, v, model, clocked, m, rank, pp)
            _megalite(*timed)  # resolves the plan, fills the buffer pool, checks the neighbours
            cpu = executor_cpu_per_action(
                lambda tl, a=timed: _megalite(*a, timeline=tl),
                n,
                clocked,
                repeats=repeats,
                num_messages=messages,
            )
            # the same with one multiply per stage: the executor's Python with warm caches
            tiny = [OneParameter(layout.stage(rank, 0) == 0)]
            clocked_tiny = ClockedP2P(**_p2p_kwargs(rank, pp))
            warm = (schedule, v, _wrapped(tiny), clocked_tiny, m, rank, pp)
            _megalite(*warm)
            cpu_tiny = executor_cpu_per_action(
                lambda tl, a=warm: _megalite(*a, timeline=tl), n, clocked_tiny, repeats=repeats
            )
            mean = torch.tensor(list(cpu) + list(cpu_tiny)) / pp
            dist.all_reduce(mean)
            profile["cpu"] = [float(x) for x in mean[: len(cpu)]]
            profile["cpu_tiny"] = [float(x) for x in mean[len(cpu) :]]
            profile["per_action"] = profile["cpu"][0]
            profile["transfer_cpu"] = profile["cpu"][6]  # ExecutorCpu.threads, per message
    if rank == 0:
        q.put((out, profile))
    dist.destroy_process_group()
    del timeline_dir


def _p2p_kwargs(rank: int, pp: int) -> dict:
    return dict(
        prev_rank=rank - 1 if rank else None,
        next_rank=rank + 1 if rank < pp - 1 else None,
        tensor_shape=(MICRO_BATCH, HIDDEN),
        dtype=torch.float32,
        device=torch.device("cpu"),
        group=dist.group.WORLD,
        pp_ranks=list(range(pp)),
    )


def _profile_all(pp, m, rank, quick=False) -> dict:
    """Stage costs (per stage count), p2p latency, effective cores: see the module docstring.
    Fresh chunks of the benchmark's shapes, profiled before any step is timed. ``quick``: fewer
    repetitions (a smoke run)."""
    repeats = dict(repeats=2, warmup=1) if quick else {}
    xs, ys = _data(m)
    batches = list(zip(xs, ys))
    stages, together, cases, all_chunks = {}, {}, {}, {}
    for schedule, v in CASES:
        cases.setdefault(layout_of(schedule, pp, v).num_stages, (schedule, v))
    for n, (schedule, v) in cases.items():
        layout, mine = layout_of(schedule, pp, v), {}
        torch.manual_seed(rank)
        all_chunks[schedule] = [
            Chunk(BLOCKS // n, layout.stage(rank, c) == 0) for c in range(layout.num_chunks)
        ]
        for turn in range(pp):  # each rank alone, in turn
            dist.barrier()
            if turn != rank:
                continue
            for c, chunk in enumerate(all_chunks[schedule]):
                s = layout.stage(rank, c)
                mine[s] = profile_chunk(
                    chunk,
                    _forward_step,
                    itertools.cycle(batches),
                    input_shape=(MICRO_BATCH, HIDDEN),
                    first=s == 0,
                    loss=s == layout.num_stages - 1,
                    num_microbatches=m,
                    **repeats,
                )
        dist.barrier()
        stages[n] = gather_stage_costs(mine)
        # the same, every rank at once and its chunks in turn, on the main thread's CPU clock:
        # each part under the caches and memory traffic of the run (every rank busy, a rank's
        # chunks alternating), without the time a rank waits for a shared core
        chunks = all_chunks[schedule]
        firsts = [layout.stage(rank, c) == 0 for c in range(len(chunks))]
        lasts = [layout.stage(rank, c) == n - 1 for c in range(len(chunks))]
        dist.barrier()
        fiws = profile_chunks(
            list(zip(chunks, firsts, lasts)),
            _forward_step,
            itertools.cycle(batches),
            input_shape=(MICRO_BATCH, HIDDEN),
            num_microbatches=m,
            clock=time.thread_time,
            **repeats,
        )
        dist.barrier()
        together[n] = gather_stage_costs({layout.stage(rank, c): fiw for c, fiw in enumerate(fiws)})
    latency = p2p_latency((MICRO_BATCH, HIDDEN), list(range(pp)), repeats=3 if quick else 11)
    # the cores the ranks get when all compute at once: the same pass timed on each rank alone
    # (the others wait in a barrier), then repeated by every rank at once for the same wall-clock
    # window (so every rank competes for the whole of it); per rank the passes done at the
    # alone-time over the window, summed over ranks (pp when they do not slow each other down).
    # Work done per second at the profiled costs would count profile_chunk's own set-up as lost
    # cores.
    layout = layout_of("1f1b", pp, 1)
    chunk, s = all_chunks["1f1b"][0], layout.stage(rank, 0)

    def one_pass() -> None:
        profile_chunk(
            chunk,
            _forward_step,
            itertools.cycle(batches),
            input_shape=(MICRO_BATCH, HIDDEN),
            first=s == 0,
            loss=s == pp - 1,
            num_microbatches=m,
            repeats=1,
            warmup=0,
        )

    alone, passes = 0.0, 1 if quick else 3
    for turn in range(pp):
        dist.barrier()
        if turn == rank:
            t0 = time.perf_counter()
            for _ in range(passes):
                one_pass()
            alone = (time.perf_counter() - t0) / passes
    # many passes on every rank, so that the last one (run while others may have stopped) weighs
    # little
    window = torch.tensor([max(0.0 if quick else 0.5, alone * passes * pp * 2)])
    dist.all_reduce(window, op=dist.ReduceOp.MAX)
    dist.barrier()
    t0, done = time.perf_counter(), 0
    while time.perf_counter() - t0 < float(window):
        one_pass()
        done += 1
    rate = torch.tensor([done * alone / (time.perf_counter() - t0)])
    dist.all_reduce(rate)
    chunk.zero_grad(set_to_none=True)
    machine = float(len(os.sched_getaffinity(0)))
    # more ranks than cores: they share the machine's cores, and what they get below those is the
    # cost of switching between them (``simulate``'s ``oversubscribed``); else the cores they get
    if pp > machine:
        cores, oversubscribed = machine, min(1.0, float(rate) / machine)
    else:
        cores, oversubscribed = min(float(pp), float(rate)), 1.0
    return {
        "stages": stages,
        "together": together,
        "latency": latency,
        "cores": cores,
        "measured_cores": float(rate),
        "oversubscribed": oversubscribed,
    }


def compute_over_profiled(spans_per_rank, layout, stages) -> float:
    """The compute spans of one measured step (every rank) summed, over the profiled F / I / W of
    the same actions: 1.0 when each computes as fast in the schedule as profiled alone."""
    ops = {word: op for op, word in LABELS.items()}
    measured = profiled = 0.0
    for rank, spans in enumerate(spans_per_rank):
        for label, begin, end in spans:
            word, _, where = label.rpartition(" ")
            if word not in ops:
                continue  # a receive wait
            f, i, w = stages[layout.stage(rank, int(where.split(".")[1]))]
            measured += end - begin
            profiled += {"F": f, "I": i, "W": w, "B": i + w}[ops[word]]
    return measured / profiled


def process_context(tiny: bool, *, torch_schedules: bool = True) -> mp.context.BaseContext:
    """Where the benchmark's ranks come from: spawned (fresh interpreters, as the measured runs
    have always been made), or for a smoke run (``tiny``) forked from this process once it has
    imported torch and megalite (and, with ``torch_schedules``, torch.distributed.pipelining):
    about 2 s of CPU each, paid once instead of once per rank. Nothing in this process has
    started a thread or a process group by then."""
    if not tiny or "fork" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    # the forked ranks inherit this process's shapes: a smoke run's are small
    global HIDDEN, MICRO_BATCH
    HIDDEN, MICRO_BATCH = SMOKE_HIDDEN, SMOKE_MICRO_BATCH
    if torch_schedules:
        try:  # torch >= 2.4; the ranks report why not where it is older
            import torch.distributed.pipelining  # noqa: F401
        except ImportError:
            pass
    return mp.get_context("fork")


def run_all(
    *, pp: int, m: int, steps: int, timeline_dir: str | None, quick: bool = False
) -> dict[str, float]:
    """Run and print every schedule; returns predicted / measured step per schedule. ``quick``:
    fewer profiling repetitions (a smoke run)."""
    ctx = process_context(quick)
    q = ctx.Queue()
    init_file = os.path.join(tempfile.mkdtemp(), "rdzv")
    procs = [
        ctx.Process(target=_worker, args=(r, pp, m, steps, init_file, timeline_dir, q, quick))
        for r in range(pp)
    ]
    for p in procs:
        p.start()
    out, profile = q.get(timeout=1800)
    for p in procs:
        p.join()
    cores, latency = profile["cores"], profile["latency"]
    lists = {
        (schedule, v): with_p2p(
            generate(schedule, pp_size=pp, num_microbatches=m, num_chunks=v),
            layout_of(schedule, pp, v),
        )
        for schedule, v in CASES
    }
    per_action = profile["per_action"]
    one = profile["stages"][pp]
    print(
        f"pp={pp} m={m}, {BLOCKS} MLP blocks of h={HIDDEN}, micro-batch {MICRO_BATCH}, "
        f"medians of {steps} steps; stage 0 alone: F {one[0][0] * 1e3:.2f} ms, I "
        f"{one[0][1] * 1e3:.2f} ms, W {one[0][2] * 1e3:.2f} ms; p2p {latency * 1e6:.0f} us; "
        f"effective cores {cores:.2f} of {len(os.sched_getaffinity(0))} (measured "
        f"{profile['measured_cores']:.2f}; a rank's speed while more ranks than cores run: "
        f"{profile['oversubscribed']:.2f} of its share)"
    )
    outside, posting, send_waits, spans, clocking, own, threads = (x * 1e6 for x in profile["cpu"])
    _, posting_warm, _, _, _, own_warm, _ = (x * 1e6 for x in profile["cpu_tiny"])
    print(
        f"executor CPU per action (1F1B, mean over ranks): {outside:.1f} us outside compute and "
        f"receive waits (the simulator's per-action cost; the model's whole F / B, autograd "
        f"set-up and graph release included, lie inside the compute spans) = posting "
        f"{posting:.1f} (the backend's send and recv calls) + send waits {send_waits:.1f} + "
        f"timeline bookkeeping {spans:.1f} + clocking {clocking:.1f} (both measuring only) + the "
        f"executor's own {own:.1f} us; beside it the backend's threads: {threads:.1f} us of CPU "
        f"per message at each end (the simulator's transfer CPU, charged where ranks share cores)"
    )
    print(
        f"  with a one-multiply model (caches warm between actions): the executor's own "
        f"{own_warm:.1f} us (its Python), posting {posting_warm:.1f} us; the rest of the "
        f"executor's own above ({max(0.0, own - own_warm):.1f} us) is its code and data coming "
        f"back into the caches after each compute"
    )
    shared = max(1.0, cores) if cores < pp else None  # the model needs a core at least
    # the prediction: stage costs profiled with every rank at once (their CPU time, under the
    # run's caches and memory traffic); beside it the one from costs profiled alone
    sims, sims_alone, ideal = {}, {}, {}
    for schedule, v in CASES:
        layout = layout_of(schedule, pp, v)
        st = profile["stages"][layout.num_stages]
        for into, stage_costs in ((sims, profile["together"]), (sims_alone, profile["stages"])):
            costs = Costs(
                stages=stage_costs[layout.num_stages],
                p2p=latency,
                per_action=per_action,
                transfer_cpu=profile["transfer_cpu"],
            )
            into[schedule] = simulate(
                lists[(schedule, v)],
                layout,
                costs,
                cores=shared,
                oversubscribed=profile["oversubscribed"],
            )
        ideal[schedule] = simulate(lists[(schedule, v)], layout, Costs(stages=st, p2p=latency))
    base = out["1f1b"][0]
    ratios = {}
    print(
        f"  {'schedule':17s} {'megalite':>9s} {'vs 1F1B: measured':>18s} {'predicted':>9s} "
        f"{'1 core/rank':>11s}   predicted step (x measured); the same from costs profiled "
        f"alone (x measured); compute in the run x profiled alone; torch"
    )
    for schedule, _v in CASES:
        ours, theirs, gathered, _ = out[schedule]
        sim = sims[schedule]
        torch_part = (
            f"torch {TORCH_CLASS[schedule]} {theirs * 1e3:7.1f} ms, ratio {ours / theirs:.3f}x"
            if isinstance(theirs, float)
            else f"torch {TORCH_CLASS[schedule]}: {theirs}"
        )
        ratios[schedule] = sim.step_time / ours
        layout = layout_of(schedule, pp, _v)
        inflation = compute_over_profiled(gathered, layout, profile["stages"][layout.num_stages])
        print(
            f"  {schedule:17s} {ours * 1e3:7.1f}ms {ours / base:18.3f} "
            f"{sim.step_time / sims['1f1b'].step_time:9.3f} "
            f"{ideal[schedule].step_time / ideal['1f1b'].step_time:11.3f}   "
            f"{sim.step_time * 1e3:6.1f} ms ({sim.step_time / ours:.2f}x); "
            f"{sims_alone[schedule].step_time / ours:.2f}x; {inflation:.2f}x; "
            f"{torch_part}"
        )
        if timeline_dir:
            os.makedirs(timeline_dir, exist_ok=True)
            for what, stages in (("measured", gathered), ("predicted", sim.spans)):
                path = os.path.join(timeline_dir, f"timeline_{schedule}_{what}.svg")
                with open(path, "w") as f:
                    f.write(render_svg(stages, f"megalite {schedule} ({what}), pp={pp}, m={m}"))
            with open(os.path.join(timeline_dir, f"timeline_{schedule}.json"), "w") as f:
                json.dump({"stages": gathered}, f)
    return ratios

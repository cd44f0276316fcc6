"""The simulator's predicted step time = the measured one (within 15%), every schedule, PP 2, m = 8.

Two gloo ranks run the real executor on layers whose forward, input-grad and weight-grad take
fixed times: each ``SleepLinear`` is a ``ColumnParallelLinear`` (so the executor defers its weight
grad into the ``WeightGradStore`` exactly as for the GPT's layers) whose autograd function sleeps
F, I and W. Every measured step records a ``Timeline``; ``simulator.costs_from_spans`` turns its
spans into ``Costs``: the mean F / I / W (B / 2 each for a fused backward) per chunk, and the
executor's own time per action (the step's time outside every span, over its actions); a
ping-pong of the same repetition gives the p2p latency. The simulator replays the same action lists
with those costs; the step lasts from the earliest start to the latest end (after a barrier;
``perf_counter`` is one clock for the processes of one machine). What the simulator must get right
is everything the costs leave out: every wait for an activation or a grad (the bubble), the turn
of a V on one rank, when W runs. The median over 5 repetitions of predicted / measured must lie
within 15% of 1.

Why sleeps, and why the step's own spans: on a loaded 2-core CI machine (8 sessions, load average
10-20 seen) compute-bound ranks are descheduled at random and the same layer takes 1x-2x from one
step to the next; sleeping layers hold no core, and costs taken from the step itself follow the
machine's mood. The comparison with real matrix multiplies and a separate profiling step is
``tools/bench/bench_pipeline.py --all`` on a quiet machine (``cpu-run-all``), where it asserts the
same 15%. The test can fail: a simulator that takes a chunk for a whole stage, or forgets the
weight grads, lands outside the bound (``test_a_wrong_simulator_is_detected``).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from megalite.core.pipeline_parallel.actions import with_p2p
from megalite.core.pipeline_parallel.forward_backward import forward_backward_pipelining
from megalite.core.pipeline_parallel.generators import generate, layout_of
from megalite.core.pipeline_parallel.model_chunk import ModelChunk
from megalite.core.pipeline_parallel.p2p import P2PCommunicator
from megalite.core.pipeline_parallel.profiling import profile_chunk
from megalite.core.pipeline_parallel.simulator import (
    LABELS,
    Costs,
    _simulate_shared,
    costs_from_spans,
    simulate,
    theory,
)
from megalite.core.pipeline_parallel.timeline import Timeline
from megalite.core.tensor_parallel.layers import ColumnParallelLinear
from tests.harness import run_distributed

WIDTH, BLOCKS, MICRO_BATCH, M, PP, REPEATS = 8, 4, 4, 8, 2, 5
SLEEP = {"F": 0.002, "I": 0.002, "W": 0.002}  # per block; a stage holds 2 blocks
CASES = [
    ("1f1b", 1),
    ("gpipe", 1),
    ("interleaved-1f1b", 2),
    ("zb-h1", 1),
    ("zb-h1", 2),
    ("zbv", 2),
    ("dualpipev", 2),
]


class _Sleep(torch.autograd.Function):
    """y = x @ w.T after sleeping F; backward sleeps I for the input grad and W for the weight
    grad (deferred into the layer's store while it defers, as megalite's linears do)."""

    @staticmethod
    def forward(ctx, x, weight, store):
        time.sleep(SLEEP["F"])
        ctx.save_for_backward(x, weight)
        ctx.store = store
        return x.matmul(weight.t())

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        time.sleep(SLEEP["I"])
        grad_in = grad_out.matmul(weight)

        def weight_grad():
            time.sleep(SLEEP["W"])
            return [weight], [grad_out.flatten(0, -2).t().matmul(x.flatten(0, -2))]

        store = ctx.store
        if store is not None and store.deferring:
            store.put(weight_grad)
            return grad_in, None, None
        return grad_in, weight_grad()[1][0], None


class SleepLinear(ColumnParallelLinear):
    def __init__(self):
        super().__init__(WIDTH, WIDTH, tp_group=None, bias=False)

    def forward(self, x):
        return _Sleep.apply(x, self.weight, self.weight_grad_store)


class Chunk(nn.Module):
    def __init__(self, n: int, first: bool):
        super().__init__()
        self.blocks = nn.Sequential(*[SleepLinear() for _ in range(n)])
        self.first, self.input_tensor = first, None

    def set_input_tensor(self, t):
        self.input_tensor = t

    def forward(self, x):
        return self.blocks(x if self.first else self.input_tensor)


def _step(schedule, chunks, p2p, xs, ys, timeline=None) -> tuple[float, float]:
    """One step; (start, end) on this rank's perf_counter."""

    def forward_step(it, model):
        i = next(it)
        return model(xs[i]), lambda o: (torch.nn.functional.mse_loss(o, ys[i]), {})

    for c in chunks:
        c.zero_grad(set_to_none=True)
    dist.barrier()
    start = time.perf_counter()
    forward_backward_pipelining(
        schedule=schedule,
        forward_step_func=forward_step,
        data_iterator=[iter(range(M)) for _ in chunks],
        model=[ModelChunk(chunk, index=c) for c, chunk in enumerate(chunks)],
        num_microbatches=M,
        p2p=p2p,
        pp_rank=dist.get_rank(),
        pp_size=PP,
        timeline=timeline,
    )
    return start, time.perf_counter()


def _p2p_latency() -> float:
    """Half a round trip of one activation between the two ranks (median of 20)."""
    buf, rank, times = torch.zeros(MICRO_BATCH, WIDTH), dist.get_rank(), []
    for _ in range(21):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        else:
            dist.recv(buf, 0)
            dist.send(buf, 0)
        times.append((time.perf_counter() - t0) / 2)
    return statistics.median(times[1:])


def _measure():
    torch.set_num_threads(1)
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(0)
    xs, ys = torch.randn(2, M, MICRO_BATCH, WIDTH, generator=g).unbind(0)
    p2p = P2PCommunicator(
        prev_rank=rank - 1 if rank else None,
        next_rank=rank + 1 if rank < PP - 1 else None,
        tensor_shape=(MICRO_BATCH, WIDTH),
        dtype=torch.float32,
        device=torch.device("cpu"),
        group=dist.group.WORLD,
        pp_ranks=list(range(PP)),
    )
    models = {}
    for schedule, v in CASES:
        torch.manual_seed(rank)
        layout = layout_of(schedule, PP, v)
        n = BLOCKS // layout.num_stages
        chunks = [Chunk(n, layout.stage(rank, c) == 0) for c in range(layout.num_chunks)]
        models[(schedule, v)] = chunks
        _step(schedule, chunks, p2p, xs, ys)  # warm-up
    out = []
    for _ in range(REPEATS):
        latency = _p2p_latency()
        steps = {}
        for case in CASES:
            tl = Timeline()
            steps[case] = (tl.spans, *_step(case[0], models[case], p2p, xs, ys, timeline=tl))
        out.append((latency, steps))
    return out


def _replay_inputs(schedule: str, v: int, per_rank: list, latency: float):
    """(layout, action lists, costs) to replay one measured step: costs from its own spans."""
    layout = layout_of(schedule, PP, v)
    lists = with_p2p(generate(schedule, pp_size=PP, num_microbatches=M, num_chunks=v), layout)
    costs = costs_from_spans(
        [spans for spans, _, _ in per_rank],
        p2p=latency,
        steps=[(s, e) for _, s, e in per_rank],
        num_actions=[len(a) for a in lists],
    )
    return layout, lists, costs


def _ratios(results, *, wrong: str | None = None) -> dict:
    """Per case, the median over repetitions of predicted / measured step time."""
    ratios = {case: [] for case in CASES}
    for rep in range(REPEATS):
        latency = max(results[r][rep][0] for r in range(PP))
        for schedule, v in CASES:
            per_rank = [results[r][rep][1][(schedule, v)] for r in range(PP)]
            measured = max(e for _, _, e in per_rank) - min(s for _, s, _ in per_rank)
            layout, lists, costs = _replay_inputs(schedule, v, per_rank, latency)
            if wrong == "chunk is a stage":  # forgets that a chunk holds 1/v of the layers
                costs = costs.scaled(v)
            elif wrong == "no weight grad":  # W (or half of a fused B) free
                costs = Costs(costs.forward, costs.backward_input, 0.0, p2p=latency)
            ratios[(schedule, v)].append(simulate(lists, layout, costs).step_time / measured)
    return {case: statistics.median(r) for case, r in ratios.items()}


_RESULTS = {}


def _results():
    if not _RESULTS:
        _RESULTS["r"] = run_distributed(_measure, PP, timeout=600)
    return _RESULTS["r"]


def test_predicted_step_time_within_15_percent_of_measured():
    ratios = _ratios(_results())
    bad = {f"{s} v{v}": round(r, 3) for (s, v), r in ratios.items() if abs(r - 1) > 0.15}
    assert not bad, f"predicted / measured outside [0.85, 1.15]: {bad}; all: {ratios}"


def test_a_wrong_simulator_is_detected():
    """The bound catches a simulator that is wrong: one that takes a chunk for a whole stage
    (every case with two chunks per rank), and one that forgets the weight grads (every case)."""
    results = _results()
    wrong = _ratios(results, wrong="chunk is a stage")
    assert all(abs(r - 1) > 0.15 for (_, v), r in wrong.items() if v == 2), wrong
    wrong = _ratios(results, wrong="no weight grad")
    assert all(abs(r - 1) > 0.15 for r in wrong.values()), wrong


def _bubbles(results) -> dict:
    """Per case, medians over repetitions of (measured, simulated) bubble. Measured: the time
    ranks wait for an activation or a grad (the executor's ``recv`` spans) plus their idle head
    and tail (before the first action, after the last, up to the step's global start and end),
    as a share of ``pp x step``; the executor's own time between actions is not bubble.
    Simulated: the replay at the step's own costs (``costs_from_spans``, p2p from the ping-pong),
    its idle time counted the same way (the executor's time on sends and receives is not idle)."""
    out = {case: ([], []) for case in CASES}
    for rep in range(REPEATS):
        latency = max(results[r][rep][0] for r in range(PP))
        for schedule, v in CASES:
            per_rank = [results[r][rep][1][(schedule, v)] for r in range(PP)]
            t0, t1 = min(s for _, s, _ in per_rank), max(e for _, _, e in per_rank)
            idle = 0.0
            for spans, _, _ in per_rank:
                idle += sum(e - s for lb, s, e in spans if lb.split()[0] == "recv")
                idle += min(s for _, s, _ in spans) - t0 + t1 - max(e for _, _, e in spans)
            layout, lists, costs = _replay_inputs(schedule, v, per_rank, latency)
            sim = simulate(lists, layout, costs)
            comm = sum(1 for acts in lists for a in acts if a.op not in LABELS) * costs.per_action
            out[(schedule, v)][0].append(idle / (PP * (t1 - t0)))
            out[(schedule, v)][1].append(
                (PP * sim.step_time - sum(sim.busy) - comm) / (PP * sim.step_time)
            )
    return {case: tuple(statistics.median(x) for x in pair) for case, pair in out.items()}


def test_measured_bubble_matches_each_schedules_formula():
    """Measured bubble vs theory per schedule, with F = I = W (the sleeps): the measured bubble
    lies within [-0.03, +0.10] of the schedule's formula (``simulator.theory``, which the replay
    at unit costs and free p2p equals, ``test_schedule_actions``) -- p2p latency and the
    executor's own time between a compute and its send only add to it: +0.03 to +0.07 seen on
    the loaded 2-core CI machine -- and within 0.08 of the simulator's replay at the step's costs;
    zb-h1 at v 2 has no closed form: below interleaved 1F1B's formula + 0.10. And the ranking the
    formulas promise holds: every bubble-cutting schedule below 1F1B. A miss is measured once
    more from fresh runs (sleeping ranks wake late on a loaded machine); a wrong schedule or
    formula misses both times."""
    bad = _bubbles_out_of_bounds(_bubbles(_results()))
    if bad:  # a timing miss under load (late wake-ups of sleeping ranks) does not repeat
        _RESULTS.clear()
        bad = _bubbles_out_of_bounds(_bubbles(_results()))
    assert not bad, f"(measured, simulated, formula) out of bounds, twice: {bad}"
    bubbles = _bubbles(_results())
    one = bubbles[("1f1b", 1)][0]
    for case in [("interleaved-1f1b", 2), ("zb-h1", 1), ("zbv", 2), ("dualpipev", 2)]:
        assert bubbles[case][0] < one, (case, bubbles)


def _bubbles_out_of_bounds(bubbles: dict) -> dict:
    bad = {}
    for (schedule, v), (measured, simulated) in bubbles.items():
        want = theory(schedule, pp_size=PP, num_microbatches=M, num_chunks=v)["bubble"]
        if schedule == "zb-h1" and v > 1:
            want = theory("interleaved-1f1b", pp_size=PP, num_microbatches=M, num_chunks=v)
            ok = measured < want["bubble"] + 0.10
            want = want["bubble"]
        else:
            ok = -0.03 < measured - want < 0.10
        if not ok or abs(measured - simulated) > 0.08:
            bad[f"{schedule} v{v}"] = tuple(round(x, 3) for x in (measured, simulated, want))
    return bad


def test_cores_shared_by_more_ranks_stretch_the_work():
    """``simulate(..., cores=c)``: with c >= pp it is the one-core-per-rank replay (the
    event-driven path agrees with it on every schedule); with fewer cores the ranks' work
    stretches: GPipe at PP 2 on one core keeps the core busy, so its step is the two ranks' total
    work, 2 m (F + B), where one core per rank gives (m + p - 1)(F + B)."""
    stages = [(1 + 0.1 * s, 1.2, 0.8 + 0.05 * s) for s in range(8)]
    costs = Costs(1.0, 1.3, 0.7, p2p=0.11, per_action=0.03, stages=stages)
    for schedule, v in CASES:
        for p in (2, 4):
            layout = layout_of(schedule, p, v)
            lists = with_p2p(
                generate(schedule, pp_size=p, num_microbatches=8, num_chunks=v), layout
            )
            one, shared = simulate(lists, layout, costs), _simulate_shared(lists, layout, costs, p)
            assert abs(one.step_time - shared.step_time) < 1e-9, (schedule, v, p)
            assert one.spans == [[(lb, s, e) for lb, s, e in r] for r in shared.spans] or all(
                abs(a[1] - b[1]) < 1e-9 and abs(a[2] - b[2]) < 1e-9
                for x, y in zip(one.spans, shared.spans)
                for a, b in zip(x, y)
            ), (schedule, v, p)
            assert simulate(lists, layout, costs, cores=p).step_time == one.step_time
    layout = layout_of("gpipe", 2)
    lists = with_p2p(generate("gpipe", pp_size=2, num_microbatches=8), layout)
    unit = Costs(1.0, 1.0, 1.0)
    # one core: total work 2 ranks x 8 x (F + B) = 48, and it is never idle once both can run
    one_core = simulate(lists, layout, unit, cores=1).step_time
    assert 48 <= one_core <= 48 + 1 + 1e-9, one_core  # at most one F of rank 0 runs alone
    assert simulate(lists, layout, unit, cores=1.5).step_time < one_core
    assert simulate(lists, layout, unit).step_time == 9 + 9 * 2  # (m + p - 1)(F + B) at 1 / rank


def test_profile_chunk_times_forward_input_grad_and_weight_grad_apart():
    """The profiling step times F, I and W of a chunk apart: each of the two sleeping blocks sleeps
    F, I and W, so each profiled time is at least two sleeps -- W too, so the weight grads were
    deferred out of I and run at W -- and the chunk is left with no grads."""
    torch.manual_seed(0)
    chunk = Chunk(2, first=False)
    x = torch.randn(MICRO_BATCH, WIDTH)

    def forward_step(it, model):
        next(it)
        return model(x), None

    f, i, w = profile_chunk(
        chunk,
        forward_step,
        iter(range(10)),
        input_shape=(MICRO_BATCH, WIDTH),
        first=False,
        loss=False,
        repeats=3,
    )
    assert f >= 2 * SLEEP["F"] and i >= 2 * SLEEP["I"] and w >= 2 * SLEEP["W"], (f, i, w)
    assert all(p.grad is None for p in chunk.parameters())
    assert all(lin.weight_grad_store is None for lin in chunk.blocks)

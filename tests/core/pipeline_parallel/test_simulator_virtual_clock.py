"""The simulator's replay = the executor's run on a virtual clock: every schedule, PP 2, m = 8.

Two gloo ranks run the real executor (``forward_backward_pipelining``) on layers that cost fixed
amounts of a virtual clock instead of time. Each ``ClockedLinear`` is a ``ColumnParallelLinear``
(so the executor defers its weight grad into the ``WeightGradStore`` exactly as for the GPT's
layers) whose autograd function advances this rank's ``VirtualClock`` by F in forward, I for the
input grad and W for the weight grad, when that runs (inside a fused B, or in the W action it was
deferred to). Every activation and grad carries, in one extra column, the virtual time the action
that produced it ended; the chunk that consumes it first waits for that time (plus the p2p latency
when it crossed ranks, none at the turn of a V). A ``VirtualTimeline`` records each action's span on
that clock. The run has the costs the simulator is given, so what the simulator must get right is
the rest: the order each rank runs its actions in, every wait for an activation or a grad (the
bubble), the turn of a V on one rank, when W runs.

- F, I, W, p2p = 1, 1.5, 0.75, 0.25 per layer: every rank's spans (label, start, end) equal the
  replay's exactly (binary fractions: no rounding), every case; a simulator that takes a chunk for
  a whole stage, or forgets the weight grads, does not (``test_a_wrong_simulator_is_detected``).
- F = I = W = 1 per layer, p2p free: the bubble counted from the executed spans (idle = pp x step
  less the busy spans) equals each schedule's formula (``simulator.theory``); ZB-H1 at v 2 (no
  closed form) lies below interleaved 1F1B's; every bubble-cutting schedule lies below 1F1B.
- ``profile_chunk`` on the virtual clock times F, I and W of a chunk apart, W out of I.

Nothing here reads a wall clock: the checks are equalities of what the schedule decides, the same
on a loaded machine as on a quiet one. The real-time comparisons, with their noise, are benchmarks:
``tools/bench/bench_pipeline_sim.py`` (real compute, profiled costs) and
``tools/bench/bench_pipeline_sleep.py`` (layers that sleep F = I = W: the step against the
simulator and the measured bubble against the formulas).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from megalite.core.pipeline_parallel.actions import with_p2p
from megalite.core.pipeline_parallel.forward_backward import forward_backward_pipelining
from megalite.core.pipeline_parallel.generators import generate, layout_of
from megalite.core.pipeline_parallel.model_chunk import ModelChunk
from megalite.core.pipeline_parallel.p2p import P2PCommunicator
from megalite.core.pipeline_parallel.profiling import profile_chunk, profile_chunks
from megalite.core.pipeline_parallel.simulator import Costs, _simulate_shared, simulate, theory
from megalite.core.pipeline_parallel.timeline import Timeline
from megalite.core.tensor_parallel.layers import ColumnParallelLinear
from tests.harness import run_distributed

WIDTH, BLOCKS, MICRO_BATCH, M, PP = 8, 4, 4, 8, 2
UNEVEN = {"F": 1.0, "I": 1.5, "W": 0.75, "p2p": 0.25}  # per layer; a stage holds 2 layers
UNIT = {"F": 1.0, "I": 1.0, "W": 1.0, "p2p": 0.0}
CASES = [
    ("1f1b", 1),
    ("gpipe", 1),
    ("interleaved-1f1b", 2),
    ("zb-h1", 1),
    ("zb-h1", 2),
    ("zbv", 2),
    ("dualpipev", 2),
]


class VirtualClock:
    """One rank's clock in cost units: work spends it, an input is waited for until its stamp.
    Called, it reads the time (a ``clock`` for ``profile_chunk``)."""

    def __init__(self, costs: dict[str, float]) -> None:
        self.costs = costs
        self.now = 0.0
        self.spent = 0.0  # all work so far: an action's duration is what it spent

    def spend(self, kind: str) -> None:
        self.now += self.costs[kind]
        self.spent += self.costs[kind]

    def wait_until(self, t: float) -> None:
        self.now = max(self.now, t)

    def __call__(self) -> float:
        return self.now


class VirtualTimeline(Timeline):
    """The executor's spans on a ``VirtualClock``: a span ends at the clock's time when its
    action returns and lasts the work the action spent (its wait for an input comes first)."""

    def __init__(self, clock: VirtualClock) -> None:
        super().__init__()
        self.clock = clock

    @contextlib.contextmanager
    def span(self, label: str):
        spent = self.clock.spent
        try:
            yield
        finally:
            end = self.clock.now
            self.spans.append((label, end - (self.clock.spent - spent), end))


def _stamped(values: torch.Tensor, t: float) -> torch.Tensor:
    """[b, WIDTH] -> [b, WIDTH + 1]: the last column holds the virtual time ``t``."""
    return torch.cat([values, values.new_full((values.shape[0], 1), t)], dim=1)


class _Clocked(torch.autograd.Function):
    """y = x @ w.T at a cost of F; backward costs I for the input grad and W for the weight grad
    (deferred into the layer's store while it defers, as megalite's linears do). Outputs and
    input grads are stamped with the clock when they are done."""

    @staticmethod
    def forward(ctx, x, weight, store, clock):
        clock.spend("F")
        ctx.save_for_backward(x, weight)
        ctx.store, ctx.clock = store, clock
        return _stamped(x[:, :-1].matmul(weight.t()), clock.now)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        clock, store, grad = ctx.clock, ctx.store, grad_out[:, :-1]
        clock.spend("I")

        def weight_grad():
            clock.spend("W")
            return [weight], [grad.t().matmul(x[:, :-1])]

        if store is not None and store.deferring:
            store.put(weight_grad)
            return _stamped(grad.matmul(weight), clock.now), None, None, None
        grad_weight = weight_grad()[1][0]  # a fused B: the input grad is done after W
        return _stamped(grad.matmul(weight), clock.now), grad_weight, None, None


class _GradArrival(torch.autograd.Function):
    """Identity; in backward the chunk waits for the grad's stamp (+ ``latency``)."""

    @staticmethod
    def forward(ctx, x, clock, latency):
        ctx.clock, ctx.latency = clock, latency
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.clock.wait_until(float(grad[0, -1]) + ctx.latency)
        return grad, None, None


class ClockedLinear(ColumnParallelLinear):
    def __init__(self, clock: VirtualClock):
        super().__init__(WIDTH, WIDTH, tp_group=None, bias=False)
        self.clock = clock

    def forward(self, x):
        return _Clocked.apply(x, self.weight, self.weight_grad_store, self.clock)


class Chunk(nn.Module):
    """``n`` clocked layers; waits for its input's stamp (+ ``latency_in``) before its forward
    and for its output grad's (+ ``latency_out``) before its backward."""

    def __init__(
        self, n: int, clock: VirtualClock, *, first: bool, latency_in=0.0, latency_out=0.0
    ):
        super().__init__()
        self.blocks = nn.Sequential(*[ClockedLinear(clock) for _ in range(n)])
        self.clock, self.first, self.input_tensor = clock, first, None
        self.latency_in, self.latency_out = latency_in, latency_out

    def set_input_tensor(self, t):
        self.input_tensor = t

    def forward(self, x):
        x = x if self.first else self.input_tensor
        self.clock.wait_until(float(x[0, -1]) + self.latency_in)
        return _GradArrival.apply(self.blocks(x), self.clock, self.latency_out)


def _run(schedule: str, v: int, costs: dict, p2p: P2PCommunicator) -> list:
    """One step of ``schedule`` on this rank; its compute spans on the virtual clock."""
    rank = dist.get_rank()
    layout = layout_of(schedule, PP, v)
    clock = VirtualClock(costs)

    def latency(stage: int) -> float:  # an input from ``stage``: from another rank?
        other = 0 <= stage < layout.num_stages and layout.place(stage)[0] != rank
        return costs["p2p"] if other else 0.0

    torch.manual_seed(rank)
    chunks = []
    for c in range(layout.num_chunks):
        s = layout.stage(rank, c)
        n = BLOCKS // layout.num_stages
        chunks.append(
            Chunk(n, clock, first=s == 0, latency_in=latency(s - 1), latency_out=latency(s + 1))
        )
    g = torch.Generator().manual_seed(0)
    xs = [_stamped(torch.randn(MICRO_BATCH, WIDTH, generator=g), 0.0) for _ in range(M)]
    ys = [torch.randn(MICRO_BATCH, WIDTH, generator=g) for _ in range(M)]

    def forward_step(it, model):
        i = next(it)
        return model(xs[i]), lambda o: (nn.functional.mse_loss(o[:, :-1], ys[i]), {})

    timeline = VirtualTimeline(clock)
    forward_backward_pipelining(
        schedule=schedule,
        forward_step_func=forward_step,
        data_iterator=[iter(range(M)) for _ in chunks],
        model=[ModelChunk(chunk, index=c) for c, chunk in enumerate(chunks)],
        num_microbatches=M,
        p2p=p2p,
        pp_rank=rank,
        pp_size=PP,
        timeline=timeline,
    )
    assert all(p.grad is not None for chunk in chunks for p in chunk.parameters())
    return [span for span in timeline.spans if span[0].split()[0] != "recv"]


def _virtual_runs() -> dict:
    rank = dist.get_rank()
    p2p = P2PCommunicator(
        prev_rank=rank - 1 if rank else None,
        next_rank=rank + 1 if rank < PP - 1 else None,
        tensor_shape=(MICRO_BATCH, WIDTH + 1),
        dtype=torch.float32,
        device=torch.device("cpu"),
        group=dist.group.WORLD,
        pp_ranks=list(range(PP)),
    )
    return {
        (name, case): _run(*case, costs, p2p)
        for name, costs in (("uneven", UNEVEN), ("unit", UNIT))
        for case in CASES
    }


_RESULTS: dict = {}


def _spans(name: str) -> dict:
    """{case: [spans of rank 0, spans of rank 1]} of the virtual runs at costs ``name``."""
    if not _RESULTS:
        _RESULTS["r"] = run_distributed(_virtual_runs, PP, timeout=600)
    per_rank = _RESULTS["r"]
    return {case: [r[(name, case)] for r in per_rank] for case in CASES}


def _replay(schedule: str, v: int, costs: dict, *, wrong: str | None = None):
    layout = layout_of(schedule, PP, v)
    lists = with_p2p(generate(schedule, pp_size=PP, num_microbatches=M, num_chunks=v), layout)
    n = BLOCKS // layout.num_stages  # layers per chunk
    f, i, w = (n * costs[k] for k in "FIW")
    if wrong == "chunk is a stage":  # forgets that a chunk holds 1/v of the layers
        f, i, w = f * v, i * v, w * v
    elif wrong == "no weight grad":  # W (or half of a fused B) free
        w = 0.0
    return simulate(lists, layout, Costs(f, i, w, p2p=costs["p2p"]))


def test_replay_equals_the_executors_run_span_for_span():
    for (schedule, v), ranks in _spans("uneven").items():
        sim = _replay(schedule, v, UNEVEN)
        for r, (run, replay) in enumerate(zip(ranks, sim.spans)):
            assert run == replay, (schedule, v, r, run[:6], replay[:6])
        assert max(e for run in ranks for _, _, e in run) == sim.step_time, (schedule, v)


def test_a_wrong_simulator_is_detected():
    """The comparison catches a simulator that is wrong: one that takes a chunk for a whole stage
    (every case with two chunks per rank), and one that forgets the weight grads (every case)."""
    for (schedule, v), ranks in _spans("uneven").items():
        if v > 1:
            assert _replay(schedule, v, UNEVEN, wrong="chunk is a stage").spans != ranks
        assert _replay(schedule, v, UNEVEN, wrong="no weight grad").spans != ranks


def test_counted_bubble_equals_each_schedules_formula():
    """At F = I = W and free p2p, the idle share of ``pp x step`` counted from the executed spans
    is the schedule's formula; the schedules that cut the bubble cut it below 1F1B's."""
    bubbles = {}
    for (schedule, v), ranks in _spans("unit").items():
        step = max(e for run in ranks for _, _, e in run)
        busy = sum(e - s for run in ranks for _, s, e in run)
        bubbles[(schedule, v)] = bubble = 1 - busy / (PP * step)
        if schedule == "zb-h1" and v > 1:  # no closed form: below interleaved 1F1B's
            inter = theory("interleaved-1f1b", pp_size=PP, num_microbatches=M, num_chunks=v)
            assert bubble < inter["bubble"], (schedule, v, bubble, inter)
            continue
        want = theory(schedule, pp_size=PP, num_microbatches=M, num_chunks=v)["bubble"]
        assert abs(bubble - want) < 1e-12, (schedule, v, bubble, want)
    one = bubbles[("1f1b", 1)]
    for case in [("interleaved-1f1b", 2), ("zb-h1", 1), ("zbv", 2), ("dualpipev", 2)]:
        assert bubbles[case] < one, (case, bubbles)


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
    """The profiling step times F, I and W of a chunk apart: on the virtual clock a chunk of two
    layers measures exactly 2 F, 2 I and 2 W -- so the weight grads were deferred out of I and
    ran at W -- and the chunk is left with no grads and no store."""
    torch.manual_seed(0)
    clock = VirtualClock(UNEVEN)
    clock.now = 1e3  # later than the stamps of profile_chunk's random output grads: no waits
    chunk = Chunk(2, clock, first=True)
    x = _stamped(torch.randn(MICRO_BATCH, WIDTH), 0.0)

    def forward_step(it, model):
        next(it)
        return model(x), None

    fiw = profile_chunk(
        chunk,
        forward_step,
        iter(range(10)),
        input_shape=(MICRO_BATCH, WIDTH + 1),
        first=True,
        loss=False,
        repeats=3,
        clock=clock,
    )
    assert fiw == (2 * UNEVEN["F"], 2 * UNEVEN["I"], 2 * UNEVEN["W"]), fiw
    assert all(p.grad is None for p in chunk.parameters())
    assert all(lin.weight_grad_store is None for lin in chunk.blocks)


def test_profile_chunks_takes_a_ranks_chunks_in_turn_and_times_each_apart():
    """Several chunks of one rank: each repetition runs F, I and W of every chunk in turn (as a
    schedule alternating them does), and each chunk gets its own F / I / W."""
    torch.manual_seed(0)
    clock = VirtualClock(UNEVEN)
    clock.now = 1e3
    chunks = [Chunk(2, clock, first=True), Chunk(3, clock, first=True)]
    x = _stamped(torch.randn(MICRO_BATCH, WIDTH), 0.0)
    calls = []

    def forward_step(it, model):
        next(it)
        calls.append(chunks.index(model))
        return model(x), None

    fiws = profile_chunks(
        [(c, True, False) for c in chunks],
        forward_step,
        iter(range(10)),
        input_shape=(MICRO_BATCH, WIDTH + 1),
        repeats=3,
        clock=clock,
    )
    assert calls == [0, 1, 0, 1, 0, 1]
    assert fiws == [tuple(n * UNEVEN[k] for k in "FIW") for n in (2, 3)], fiws
    assert all(p.grad is None for c in chunks for p in c.parameters())

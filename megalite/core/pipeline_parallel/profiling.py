"""A short profiling step for the simulator: F / I / W of every stage and the p2p latency.

    fiw = profile_chunk(chunk, forward_step_func, data_iterator, input_shape=(s, b, h),
                        first=..., loss=..., num_microbatches=m)
    costs = Costs(stages=gather_stage_costs({stage: fiw, ...}, group), p2p=p2p_latency(...))

``profile_chunk`` times one chunk of this rank alone (the ranks take turns, so no rank's numbers
are stretched by another's work on a shared core): a forward through ``forward_step_func`` as the
executor calls it (the input is set with ``set_input_tensor``; the loss stage applies the loss
and divides by ``num_microbatches``), its input-grad backward with the chunk's linear layers
deferring their weight grads into a ``WeightGradStore`` (as an ``I`` action does), then those
weight grads (a ``W``). The first ``warmup`` repetitions are dropped, the median of the rest is
returned as seconds ``(F, I, W)``. The chunk's grads are cleared afterwards. ``profile_chunks``
times several of one rank's chunks in turn within each repetition, as a schedule that
alternates them runs them.

``executor_seconds_per_action`` is the executor's CPU time per action: the main thread's CPU
time over a step minus its CPU time inside the step's spans (compute and receive waits), per
action (the simulator's ``Costs.per_action``). CPU time, not wall time: a rank descheduled on a
loaded machine spends no CPU, so the figure measures the work, not the machine's load. It is
more than the executor's own work: it holds the backend's posting of every send and receive (on
gloo a C++ call per op that builds a work and writes to a socket), the waits for the sends at the
end of the step, and the timeline's bookkeeping of its spans. ``executor_cpu_per_action`` splits
it into those parts and the executor's own rest, with a communicator that clocks its posting
calls and send waits (``ClockedP2P``).

``p2p_latency`` is half the median round trip of one activation between neighbouring pipeline
ranks (each pair in turn, the others waiting at a barrier); ``gather_stage_costs`` shares every
rank's per-stage numbers so each rank holds the list ``Costs(stages=...)`` takes.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from megalite.core.pipeline_parallel.p2p import P2PCommunicator
from megalite.core.pipeline_parallel.timeline import Timeline
from megalite.core.tensor_parallel.layers import WeightGradStore, attach_weight_grad_store


def profile_chunk(
    chunk: nn.Module,
    forward_step_func: Callable,
    data_iterator: Iterator,
    *,
    first: bool,
    loss: bool,
    **kwargs,
) -> tuple[float, float, float]:
    """Median seconds of (F, I, W) of ``chunk`` run alone; ``data_iterator`` yields at least
    ``repeats`` micro-batches (``first``: the chunk holds stage 0, ``loss``: the last stage).
    ``chunk`` is the stage module (``ModelChunk.module``: it takes ``set_input_tensor``). The
    other keywords (``input_shape``, ``num_microbatches``, ``repeats``, ``warmup``, ``dtype``,
    ``device``, ``clock``: the time source read around each part, a test passes a virtual one)
    as ``profile_chunks``."""
    return profile_chunks([(chunk, first, loss)], forward_step_func, data_iterator, **kwargs)[0]


def profile_chunks(
    chunks: list[tuple[nn.Module, bool, bool]],
    forward_step_func: Callable,
    data_iterator: Iterator,
    *,
    input_shape: tuple[int, ...],
    num_microbatches: int = 1,
    repeats: int = 7,
    warmup: int = 1,
    dtype: torch.dtype = torch.float32,
    device: torch.device | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> list[tuple[float, float, float]]:
    """``profile_chunk`` of several chunks ``(chunk, first, loss)`` of one rank, taken in turn
    within each repetition (F, I, W of the first, then of the second, ...), so each part runs
    with the caches the rank's other chunks leave, as in a schedule that alternates them."""
    if repeats <= warmup or warmup < 0:
        raise ValueError(f"profile_chunk: repeats ({repeats}) must exceed warmup ({warmup})")
    stores = [WeightGradStore() for _ in chunks]
    for (chunk, _, _), store in zip(chunks, stores):
        attach_weight_grad_store(chunk, store)
    times: list[list[tuple[float, float, float]]] = [[] for _ in chunks]
    try:
        for k in range(repeats):
            for (chunk, first, loss), store, kept in zip(chunks, stores, times):
                x = None if first else torch.randn(input_shape, dtype=dtype, device=device)
                grad = None if loss else torch.randn(input_shape, dtype=dtype, device=device)
                t0 = clock()  # F and I hold what the executor's spans hold (``executor.py``)
                if x is not None:
                    x.requires_grad_()
                chunk.set_input_tensor(x)
                output, loss_func = forward_step_func(data_iterator, chunk)
                if loss:
                    output = loss_func(output)[0] / num_microbatches
                t1 = clock()
                with store.defer(k):
                    output.backward(grad)
                output = None  # the graph's release, as in the executor's B / I span
                t2 = clock()
                store.flush(k)
                t3 = clock()
                chunk.set_input_tensor(None)
                kept.append((t1 - t0, t2 - t1, t3 - t2))
    finally:
        for chunk, _, _ in chunks:
            attach_weight_grad_store(chunk, None)
            chunk.zero_grad(set_to_none=True)
    return [
        tuple(statistics.median(t[i] for t in kept[warmup:]) for i in range(3))  # type: ignore[misc]
        for kept in times
    ]


def executor_seconds_per_action(
    step: Callable[[Timeline], object], num_actions: int, *, repeats: int = 3
) -> float:
    """Median over ``repeats`` steps of the main thread's CPU seconds per action outside every
    span: ``step(timeline)`` runs one step of the executor recording into ``timeline`` (a
    ``Timeline`` on ``time.thread_time``); ``num_actions``: this rank's actions in the step (its
    ``with_p2p`` list: compute, sends and receives)."""
    if repeats < 1 or num_actions < 1:
        raise ValueError(
            f"executor_seconds_per_action: repeats ({repeats}) and num_actions ({num_actions}) "
            "must be >= 1"
        )
    samples = []
    for _ in range(repeats):
        timeline = Timeline(clock=time.thread_time)
        start = time.thread_time()
        step(timeline)
        total = time.thread_time() - start
        inside = sum(end - begin for _, begin, end in timeline.spans)
        samples.append(max(0.0, total - inside) / num_actions)
    return statistics.median(samples)


class ClockedP2P(P2PCommunicator):
    """A ``P2PCommunicator`` that adds the main thread's CPU time inside the backend's posting
    calls (``post``, or the group's ``send`` / ``recv`` that ``direct`` hands the executor) to
    ``posting_seconds``, and inside the waits for its sends to ``send_wait_seconds``. For
    measuring only: each clocked call costs two more clock reads."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.posting_seconds = self.send_wait_seconds = 0.0
        self.clocked_posts = self.clocked_waits = 0  # what ``_clocking_cost`` is paid for

    def post(self, batch: list) -> list:
        start = time.thread_time()
        works = super().post(batch)
        self.posting_seconds += time.thread_time() - start
        self.clocked_posts += 1
        return [_ClockedWait(w, self) if send else w for w, (send, *_) in zip(works, batch)]

    def direct(self, send: bool, peer: int) -> tuple[Callable | None, int]:
        call, group_rank = super().direct(send, peer)
        if call is None:
            return call, group_rank
        return _clocked(call, self, send), group_rank


def _clocked(call: Callable, p2p, send: bool) -> Callable:
    """``call`` (a backend posting call) with its CPU time added to ``p2p.posting_seconds``; a
    send's work comes back as a ``_ClockedWait``. ``ClockedP2P.direct``'s wrapper, and what
    ``_clocking_cost`` measures."""

    def clocked(tensors: list, rank: int, tag: int):
        start = time.thread_time()
        work = call(tensors, rank, tag)
        p2p.posting_seconds += time.thread_time() - start
        p2p.clocked_posts += 1
        return _ClockedWait(work, p2p) if send else work

    return clocked


class _ClockedWait:
    """A send's work whose ``wait`` adds its CPU time to ``ClockedP2P.send_wait_seconds``."""

    def __init__(self, work, p2p: ClockedP2P):
        self.work, self.p2p = work, p2p

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def wait(self):
        start = time.thread_time()
        done = self.work.wait()
        self.p2p.send_wait_seconds += time.thread_time() - start
        self.p2p.clocked_waits += 1
        return done


class ExecutorCpu(NamedTuple):
    """CPU seconds per action of one rank's step (medians over steps). ``outside``: outside
    compute and receive waits (``executor_seconds_per_action``; the simulator's per-action cost),
    made of ``posting`` (the backend's posting calls), ``send_waits`` (waiting for the sends),
    ``timeline`` (the spans' own bookkeeping) and ``clocking`` (``ClockedP2P``'s wrappers around
    the posting calls and send waits, outside their clock reads), both there only while
    measuring, and ``own``: the rest, the executor's own work between compute and communication
    (its Python, and the cache misses it meets after a compute). Apart from those, per message
    (a send or a receive) rather than per action: ``threads``, the CPU of the process's other
    threads over the step (the backend's: gloo moves every message's bytes on its socket loop
    thread; the simulator's ``Costs.transfer_cpu``)."""

    outside: float
    posting: float
    send_waits: float
    timeline: float
    clocking: float
    own: float
    threads: float = 0.0


def _span_cost(spans: int = 200) -> float:
    """CPU seconds a ``Timeline`` on ``time.thread_time`` spends outside its spans, per span."""
    timeline = Timeline(clock=time.thread_time)
    start = time.thread_time()
    for _ in range(spans):
        with timeline.span("x"):
            pass
    total = time.thread_time() - start
    return max(0.0, total - sum(end - begin for _, begin, end in timeline.spans)) / spans


def _clocking_cost(calls: int = 2000) -> tuple[float, float]:
    """CPU seconds ``ClockedP2P`` adds outside its clock reads per clocked posting call and per
    clocked send wait, over what the same calls cost unwrapped (a stand-in call and work)."""

    class Work:
        def wait(self) -> bool:
            return True

    def call(tensors: list, rank: int, tag: int) -> Work:
        return Work()

    class Counters:  # what ``ClockedP2P``'s wrappers add to: no communicator needed
        posting_seconds = send_wait_seconds = 0.0
        clocked_posts = clocked_waits = 0

    clocked_p2p = Counters()
    clocked = _clocked(call, clocked_p2p, send=True)

    start = time.thread_time()
    for _ in range(calls):
        call([None], 1, 0)
    plain_post = time.thread_time() - start
    works = [clocked([None], 1, 0) for _ in range(calls)]
    clocked_p2p.posting_seconds = 0.0
    start = time.thread_time()
    for _ in range(calls):
        clocked([None], 1, 0)
    clocked_post = time.thread_time() - start
    plain = [w.work for w in works]
    start = time.thread_time()
    for w in plain:
        w.wait()
    plain_wait = time.thread_time() - start
    clocked_p2p.send_wait_seconds = 0.0
    start = time.thread_time()
    for w in works:
        w.wait()
    clocked_wait = time.thread_time() - start - clocked_p2p.send_wait_seconds
    per_post = max(0.0, clocked_post - clocked_p2p.posting_seconds - plain_post) / calls
    return per_post, max(0.0, clocked_wait - plain_wait) / calls


def executor_cpu_per_action(
    step: Callable[[Timeline], object],
    num_actions: int,
    p2p: ClockedP2P,
    *,
    repeats: int = 3,
    num_messages: int = 0,
) -> ExecutorCpu:
    """``executor_seconds_per_action`` split into its parts: ``step(timeline)`` runs one step of
    the executor over ``p2p`` recording into ``timeline``; each part is the median over
    ``repeats`` steps, per action; ``own`` is what the others leave of ``outside``.
    ``num_messages``: the sends and receives among the actions (``threads`` is per message; 0:
    not measured)."""
    if repeats < 1 or num_actions < 1:
        raise ValueError(
            f"executor_cpu_per_action: repeats ({repeats}) and num_actions ({num_actions}) "
            "must be >= 1"
        )
    per_span = _span_cost()
    per_post, per_wait = _clocking_cost()
    parts: list[tuple[float, float, float, float, float, float]] = []
    for _ in range(repeats):
        p2p.posting_seconds = p2p.send_wait_seconds = 0.0
        p2p.clocked_posts = p2p.clocked_waits = 0
        timeline = Timeline(clock=time.thread_time)
        start, process = time.thread_time(), time.process_time()
        step(timeline)
        total = time.thread_time() - start
        others = time.process_time() - process - total
        inside = sum(end - begin for _, begin, end in timeline.spans)
        parts.append(
            (
                max(0.0, total - inside) / num_actions,
                p2p.posting_seconds / num_actions,
                p2p.send_wait_seconds / num_actions,
                per_span * len(timeline.spans) / num_actions,
                (per_post * p2p.clocked_posts + per_wait * p2p.clocked_waits) / num_actions,
                max(0.0, others) / num_messages if num_messages else 0.0,
            )
        )
    outside, posting, send_waits, spans, clocking, threads = (
        statistics.median(p[i] for p in parts) for i in range(6)
    )
    own = max(0.0, outside - posting - send_waits - spans - clocking)
    return ExecutorCpu(outside, posting, send_waits, spans, clocking, own, threads)


def gather_stage_costs(
    mine: dict[int, tuple[float, float, float]], group: dist.ProcessGroup | None = None
) -> list[tuple[float, float, float]]:
    """Every rank's ``{global stage: (F, I, W)}`` merged into one list indexed by stage."""
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    merged = {s: fiw for d in everyone for s, fiw in d.items()}
    missing = [s for s in range(len(merged)) if s not in merged]
    if missing or not merged:
        raise ValueError(f"gather_stage_costs: no profile for stage(s) {missing}")
    return [merged[s] for s in range(len(merged))]


def p2p_latency(
    shape: tuple[int, ...],
    pp_ranks: list[int],
    *,
    group: dist.ProcessGroup | None = None,
    repeats: int = 11,
    dtype: torch.dtype = torch.float32,
) -> float:
    """Half the median round trip of one ``shape`` tensor between neighbouring pipeline ranks
    (``pp_ranks``: the global ranks of this pipeline, in stage order); the same on every rank."""
    me = dist.get_rank()
    buf = torch.zeros(shape, dtype=dtype)
    samples: list[float] = []
    for a, b in zip(pp_ranks, pp_ranks[1:]):
        for _ in range(repeats + 1):
            dist.barrier(group=group)
            t0 = time.perf_counter()
            if me == a:
                dist.send(buf, b, group=group)
                dist.recv(buf, b, group=group)
                samples.append((time.perf_counter() - t0) / 2)
            elif me == b:
                dist.recv(buf, a, group=group)
                dist.send(buf, a, group=group)
    mine = torch.tensor([statistics.median(samples[1:]) if samples else 0.0])  # 1st: warm-up
    count = torch.tensor([1.0 if samples else 0.0])
    dist.all_reduce(mine, group=group)
    dist.all_reduce(count, group=group)
    return float(mine / count.clamp_min(1))

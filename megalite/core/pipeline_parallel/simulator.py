"""Predict a schedule's step from its action lists: step time, bubble, activations in flight.

    costs = Costs(forward=1.0, backward_input=1.0, backward_weight=1.0, p2p=0.05)
    sim = simulate(lists, layout, costs)
    sim.step_time, sim.bubble, sim.peak_in_flight   # per rank: chunk-micro-batches held
    sim.spans                                        # per rank [(label, start, end)], drawable

The replay follows the executor's rules: each rank runs its list in order; a compute action starts
when the rank is free and its inputs have arrived (a receive lands ``p2p`` after the matching
send, which leaves when the producing action ends; sends and posted receives cost the rank
nothing); B costs ``backward_input + backward_weight``. Costs may be given per chunk (a list) when
chunks differ (the first holds the embedding, the last the output layer). A list that cannot run
(a receive with no send, or a wait cycle) raises ``ScheduleDeadlock`` naming the stuck actions, so
every generator is checked without processes.

Costs per global stage (``Costs(stages=[(F, I, W), ...])``, e.g. profiled on every rank by
``profiling.profile_chunk`` and shared by ``profiling.gather_stage_costs``) replace the per-chunk
ones: the first stage holds the embedding, the last the output layer and the loss.

Ranks sharing cores (``simulate(..., cores=c)``): on a machine with fewer cores than pipeline
ranks (PP 4 on 2 CPU cores), a rank's work is stretched while more ranks than cores have work to
do. The replay is then event-driven, processor sharing: at every moment the ``n`` ranks whose next
action can run progress at ``min(1, c / n)`` of their speed (a rank waiting for an activation
holds no core), times ``oversubscribed`` while ``n > c`` (the switching between more runnable
ranks than cores, each refilling its caches: measured, e.g., as the cores all ranks computing at
once really get over the machine's cores); every action, sends and posted receives included,
costs ``per_action`` of CPU work on top of its compute, and each message ``transfer_cpu`` at
either end, run beside the ranks (the backend's threads: a runnable share of the cores from the
send until that work is done). Spans are stretched accordingly, so ``bubble`` then counts only
time a rank could not run, not time it ran slower. ``cores=None`` (or ``>= pp_size``): one core
per rank, the replay above (the backend's threads then run on the cores of ranks that wait).

Activations in flight on a rank: chunk-micro-batches whose forward ran and whose B (or I) has not;
one unit is one micro-batch's activations of one chunk. After I only what W needs stays (each
linear layer's input and output grad): ``peak_until_w`` counts those too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megalite.core.pipeline_parallel.actions import Action, StageLayout
from megalite.core.pipeline_parallel.generators import V_SHAPED
from megalite.core.pipeline_parallel.timeline import LABELS, span_label


class ScheduleDeadlock(RuntimeError):
    pass


@dataclass
class Costs:
    forward: float | list[float] = 1.0
    backward_input: float | list[float] = 1.0
    backward_weight: float | list[float] = 1.0
    p2p: float = 0.0
    per_action: float = 0.0  # executor CPU per action (profiling.executor_seconds_per_action)
    # CPU the backend's own threads spend per message at each end (gloo's socket loop), taken
    # from the cores the ranks share; only a replay with ``cores`` charges it
    transfer_cpu: float = 0.0
    # per global stage (F, I, W); when given it replaces the per-chunk values above
    stages: list[tuple[float, float, float]] | None = None

    def of(self, op: str, chunk: int) -> float:
        def pick(v):
            return v[chunk] if isinstance(v, (list, tuple)) else v

        if op == "F":
            return pick(self.forward)
        if op == "I":
            return pick(self.backward_input)
        if op == "W":
            return pick(self.backward_weight)
        if op == "B":
            return pick(self.backward_input) + pick(self.backward_weight)
        return 0.0

    def of_stage(self, op: str, stage: int, chunk: int) -> float:
        """The cost of ``op`` on global stage ``stage`` (chunk ``chunk`` of its rank)."""
        if self.stages is None:
            return self.of(op, chunk)
        f, i, w = self.stages[stage]
        return {"F": f, "I": i, "W": w, "B": i + w}.get(op, 0.0)

    def scaled(self, factor: float) -> Costs:
        """Every compute cost times ``factor`` (e.g. ``1 / v``: a chunk of a stage cut in v);
        p2p unchanged."""

        def times(v):
            return [x * factor for x in v] if isinstance(v, (list, tuple)) else v * factor

        stages = None
        if self.stages is not None:
            stages = [tuple(x * factor for x in fiw) for fiw in self.stages]
        return Costs(
            times(self.forward),
            times(self.backward_input),
            times(self.backward_weight),
            p2p=self.p2p,
            per_action=self.per_action,
            stages=stages,
            transfer_cpu=self.transfer_cpu,
        )


@dataclass
class Simulation:
    step_time: float
    busy: list[float]
    peak_in_flight: list[int]  # chunk-micro-batches between F and B / I
    peak_until_w: list[int]  # between F and B / W (W keeps the linear layers' inputs)
    spans: list[list[tuple[str, float, float]]] = field(default_factory=list)

    @property
    def bubble(self) -> float:
        """Idle fraction of ``pp_size x step_time``."""
        p = len(self.busy)
        return 1.0 - sum(self.busy) / (p * self.step_time) if self.step_time > 0 else 0.0


def simulate(
    lists: list[list[Action]],
    layout: StageLayout,
    costs: Costs,
    *,
    cores: float | None = None,
    oversubscribed: float = 1.0,
) -> Simulation:
    """Replay ``lists`` (one per rank, with their sends and receives) at ``costs``; ``cores``: how
    many cores the ``pp_size`` ranks share (None: one each); ``oversubscribed``: the share of its
    speed a runnable rank keeps, beyond its ``cores / runnable`` share, while more ranks than
    cores are runnable (what switching between them and refilling their caches costs; 1.0: none).
    """
    if cores is not None and cores < 1:
        raise ValueError(f"simulate: cores must be >= 1 (or None: one per rank), got {cores}")
    if not 0 < oversubscribed <= 1:
        raise ValueError(f"simulate: oversubscribed must lie in (0, 1], got {oversubscribed}")
    if cores is not None and cores < layout.pp_size:
        return _simulate_shared(lists, layout, costs, cores, oversubscribed)
    p, S = layout.pp_size, layout.num_stages
    pos = [0] * p
    free = [0.0] * p
    busy = [0.0] * p
    in_flight, peak = [0] * p, [0] * p
    waiting_w, peak_w = [0] * p, [0] * p
    spans: list[list[tuple[str, float, float]]] = [[] for _ in range(p)]
    arrival: dict[tuple[str, int, int], float] = {}  # (kind, mb, receiving stage) -> time
    done: dict[tuple[str, int, int], float] = {}  # (op, mb, stage) -> end time
    remaining = sum(len(a) for a in lists)
    while remaining:
        moved = False
        for r in range(p):
            while pos[r] < len(lists[r]):
                a = lists[r][pos[r]]
                s = layout.stage(r, a.chunk)
                start = free[r]
                if a.op in ("RECV_F", "RECV_B"):
                    free[r] += costs.per_action  # posted; the consumer waits for the arrival
                elif a.op == "SEND_F":
                    t = done.get(("F", a.microbatch, s))
                    if t is None:
                        break
                    arrival[("F", a.microbatch, s + 1)] = t + costs.p2p
                    free[r] += costs.per_action
                elif a.op == "SEND_B":
                    t = done.get(("IB", a.microbatch, s))
                    if t is None:
                        break
                    arrival[("B", a.microbatch, s - 1)] = t + costs.p2p
                    free[r] += costs.per_action
                else:
                    ready = _inputs_ready(a, s, r, layout, arrival, done)
                    if ready is None:
                        break
                    start = max(free[r], ready)
                    end = start + costs.per_action + costs.of_stage(a.op, s, a.chunk)
                    free[r] = end
                    busy[r] += end - start
                    spans[r].append((span_label(a.op, a.microbatch, a.chunk), start, end))
                    key = "IB" if a.op in ("I", "B") else a.op
                    done[(key, a.microbatch, s)] = end
                    if a.op == "F":
                        in_flight[r] += 1
                        peak[r] = max(peak[r], in_flight[r])
                        if s < S - 1 and layout.place(s + 1)[0] == r:  # the turn of a V
                            arrival[("F", a.microbatch, s + 1)] = end
                    if a.op in ("B", "I"):
                        in_flight[r] -= 1
                    if a.op in ("F", "B", "W"):
                        waiting_w[r] += {"F": 1, "B": -1, "W": -1}[a.op]
                        peak_w[r] = max(peak_w[r], waiting_w[r])
                    if a.op in ("B", "I") and s > 0 and layout.place(s - 1)[0] == r:
                        arrival[("B", a.microbatch, s - 1)] = end
                pos[r] += 1
                remaining -= 1
                moved = True
        if not moved:
            stuck = [
                str(lists[r][pos[r]]) + f"@rank{r}" for r in range(p) if pos[r] < len(lists[r])
            ]
            raise ScheduleDeadlock(f"the action lists cannot proceed: stuck at {', '.join(stuck)}")
    return Simulation(max(free), busy, peak, peak_w, spans)


def _simulate_shared(
    lists: list[list[Action]],
    layout: StageLayout,
    costs: Costs,
    cores: float,
    crowded: float = 1.0,
) -> Simulation:
    """Event-driven replay where the runnable ranks share ``cores`` (processor sharing), each at
    ``crowded`` of its share while they outnumber the cores."""
    p, S = layout.pp_size, layout.num_stages
    pos = [0] * p
    work: list[float | None] = [None] * p  # CPU work left of the action running on each rank
    began = [0.0] * p
    busy = [0.0] * p
    in_flight, peak = [0] * p, [0] * p
    waiting_w, peak_w = [0] * p, [0] * p
    spans: list[list[tuple[str, float, float]]] = [[] for _ in range(p)]
    arrival: dict[tuple[str, int, int], float] = {}
    done: dict[tuple[str, int, int], float] = {}
    t, end_of = 0.0, [0.0] * p
    threads: list[float] = []  # CPU work left of each message's backend thread work
    scale = max(
        [costs.per_action, costs.p2p, 1e-300]
        + [
            costs.of_stage(op, layout.stage(r, c), c)
            for r in range(p)
            for c in range(layout.num_chunks)
            for op in ("F", "B")
        ]
    )
    eps = 1e-9 * scale

    def ready_at(r: int) -> float | None:
        a = lists[r][pos[r]]
        s = layout.stage(r, a.chunk)
        if a.op == "SEND_F":
            return 0.0 if ("F", a.microbatch, s) in done else None
        if a.op == "SEND_B":
            return 0.0 if ("IB", a.microbatch, s) in done else None
        if a.op in ("RECV_F", "RECV_B"):
            return 0.0
        return _inputs_ready(a, s, r, layout, arrival, done)

    def finish(r: int, now: float) -> None:
        a = lists[r][pos[r]]
        s = layout.stage(r, a.chunk)
        if a.op in ("SEND_F", "SEND_B") and costs.transfer_cpu > 0:
            threads.extend([costs.transfer_cpu] * 2)  # the sending and the receiving end
        if a.op == "SEND_F":
            arrival[("F", a.microbatch, s + 1)] = done[("F", a.microbatch, s)] + costs.p2p
        elif a.op == "SEND_B":
            arrival[("B", a.microbatch, s - 1)] = done[("IB", a.microbatch, s)] + costs.p2p
        elif a.op in LABELS:
            busy[r] += now - began[r]
            spans[r].append((span_label(a.op, a.microbatch, a.chunk), began[r], now))
            done[("IB" if a.op in ("I", "B") else a.op, a.microbatch, s)] = now
            if a.op == "F":
                in_flight[r] += 1
                peak[r] = max(peak[r], in_flight[r])
                if s < S - 1 and layout.place(s + 1)[0] == r:  # the turn of a V
                    arrival[("F", a.microbatch, s + 1)] = now
            if a.op in ("B", "I"):
                in_flight[r] -= 1
                if s > 0 and layout.place(s - 1)[0] == r:
                    arrival[("B", a.microbatch, s - 1)] = now
            if a.op in ("F", "B", "W"):
                waiting_w[r] += {"F": 1, "B": -1, "W": -1}[a.op]
                peak_w[r] = max(peak_w[r], waiting_w[r])
        work[r] = None
        pos[r] += 1
        end_of[r] = now

    while any(pos[r] < len(lists[r]) for r in range(p)):
        started = True
        while started:  # start what can start now; finish what costs nothing
            started = False
            for r in range(p):
                if pos[r] >= len(lists[r]) or work[r] is not None:
                    continue
                ready = ready_at(r)
                if ready is None or ready > t + eps:
                    continue
                a = lists[r][pos[r]]
                work[r] = costs.per_action + costs.of_stage(a.op, layout.stage(r, a.chunk), a.chunk)
                began[r] = t
                if work[r] <= eps:
                    finish(r, t)
                    started = True
        running = [r for r in range(p) if work[r] is not None]
        future = [
            x
            for r in range(p)
            if pos[r] < len(lists[r]) and work[r] is None
            for x in [ready_at(r)]
            if x is not None and x > t + eps
        ]
        if not running and not future and not threads:
            if all(pos[r] >= len(lists[r]) for r in range(p)):
                break
            stuck = [
                str(lists[r][pos[r]]) + f"@rank{r}" for r in range(p) if pos[r] < len(lists[r])
            ]
            raise ScheduleDeadlock(f"the action lists cannot proceed: stuck at {', '.join(stuck)}")
        n = len(running) + len(threads)
        rate = 1.0 if n <= cores else cores / n * crowded
        dt = min(
            [work[r] / rate for r in running]
            + [w / rate for w in threads]
            + [x - t for x in future]
        )
        t += dt
        threads[:] = [left for w in threads if (left := w - dt * rate) > eps]
        for r in running:
            work[r] -= dt * rate
            if work[r] <= eps:
                finish(r, t)
    return Simulation(max(end_of), busy, peak, peak_w, spans)


def _inputs_ready(a: Action, s: int, r: int, layout, arrival, done) -> float | None:
    S = layout.num_stages
    if a.op == "F":
        if s == 0:
            return 0.0
        return arrival.get(("F", a.microbatch, s))
    if a.op in ("B", "I"):
        if ("F", a.microbatch, s) not in done:
            raise ScheduleDeadlock(f"{a} at rank {r} runs before its forward")
        if s == S - 1:
            return done[("F", a.microbatch, s)]
        return arrival.get(("B", a.microbatch, s))
    if a.op == "W":
        t = done.get(("IB", a.microbatch, s))
        if t is None:
            raise ScheduleDeadlock(f"{a} at rank {r} runs before its I")
        return t
    return 0.0


def theory(schedule: str, *, pp_size: int, num_microbatches: int, num_chunks: int = 1) -> dict:
    """The textbook numbers at F = I = W = 1 (B = 2), p2p free: bubble fraction and the peak
    activations of rank 0 in chunk-micro-batches (1F1B: ``p``; one chunk-micro-batch of a V or
    interleaved chunk holds ``1/v`` of a stage's layers)."""
    p, m, v = pp_size, num_microbatches, num_chunks
    if schedule in ("1f1b", "gpipe"):
        bubble = (p - 1) / (m + p - 1)
        peak = min(p, m) if schedule == "1f1b" else m
    elif schedule == "interleaved-1f1b":
        bubble = (p - 1) / (v * m + p - 1)
        peak = min(2 * (p - 1) + (v - 1) * p + 1, m * v)
    elif schedule == "zb-h1":  # (p - 1)(F + I - W): a third of 1F1B's at F = I = W
        bubble = (p - 1) / (3 * v * m + p - 1)
        peak = min(p, m) if v == 1 else min(v * p, m * v)  # v > 1: the bubble is a lower bound
    elif schedule in V_SHAPED:  # in chunk units (a chunk is half a stage)
        bubble = (p - 1) / (6 * m + p - 1)
        peak = 2 * p if schedule == "zbv" else 2 * p + 1
    else:
        raise ValueError(f"unknown schedule {schedule!r}")
    return {"bubble": bubble, "peak_in_flight": peak}

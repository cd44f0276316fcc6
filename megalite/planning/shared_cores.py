"""A pipeline's step when its ranks share CPU cores: the schedule's action lists replayed with
processor sharing.

The core simulator (``pipeline_parallel.simulator``) gives every rank its own device: a rank idle in
the bubble costs the step its idle time. On a CPU, ranks are processes on ``cores`` shared cores: a
rank waiting for a receive sleeps (gloo blocks, it does not spin) and lends its core to the ranks
that compute. Here every computing rank runs at ``min(1, cores / busy)`` of its own speed, where
``busy`` is the number of processes computing at that moment (``group`` processes per pipeline rank:
its tensor/data/context-parallel peers run in step with it). With ``cores`` at least the world size
this is the core simulator's replay (same dependencies: an F waits for its input's arrival, a B or
I for its output grad and its own F, a W for its I; a hop between ranks costs ``p2p``, the turn of
a V none), which ``tests/planning`` checks on every schedule.
"""

from __future__ import annotations

from collections.abc import Callable

from megalite.core.pipeline_parallel.actions import Action, StageLayout

EPS = 1e-12


def replay(
    compute: list[list[Action]],
    layout: StageLayout,
    cost: Callable[[int, Action], float],
    *,
    p2p: float,
    cores: float,
    group: int = 1,
) -> tuple[float, list[float]]:
    """(makespan, each rank's compute seconds at full speed) of the compute lists (``generate``'s
    F / B / I / W, no sends) with ``cost(rank, action)`` seconds per action on a core of its own."""
    p, last = layout.pp_size, layout.num_stages - 1
    pos = [0] * p
    remaining = [None] * p  # work left of the current action (None: not started)
    work = [0.0] * p
    arrival: dict[tuple[str, int, int], float] = {}
    done: dict[tuple[str, int, int], float] = {}
    now = 0.0

    def ready_at(r: int) -> float | None:
        a = compute[r][pos[r]]
        s = layout.stage(r, a.chunk)
        if a.op == "F":
            return 0.0 if s == 0 else arrival.get(("F", a.microbatch, s))
        if a.op in ("B", "I"):
            own = done.get(("F", a.microbatch, s))
            grad = own if s == last else arrival.get(("B", a.microbatch, s))
            return None if own is None or grad is None else max(own, grad)
        return done.get(("IB", a.microbatch, s))  # W

    while any(pos[r] < len(compute[r]) for r in range(p)):
        ready = {r: ready_at(r) for r in range(p) if pos[r] < len(compute[r])}
        running = [r for r, t in ready.items() if t is not None and t <= now + EPS]
        future = [t for t in ready.values() if t is not None and t > now + EPS]
        if not running:
            if not future:
                stuck = ", ".join(f"{compute[r][pos[r]]}@rank{r}" for r in ready)
                raise RuntimeError(f"the action lists cannot proceed: stuck at {stuck}")
            now = min(future)
            continue
        speed = min(1.0, cores / (len(running) * group))
        for r in running:
            if remaining[r] is None:
                remaining[r] = cost(r, compute[r][pos[r]])
                work[r] += remaining[r]
        dt = min(remaining[r] / speed for r in running)
        if future:
            dt = min(dt, min(future) - now)
        now += dt
        for r in running:
            remaining[r] -= dt * speed
            if remaining[r] > EPS:
                continue
            a = compute[r][pos[r]]
            s = layout.stage(r, a.chunk)
            done[("IB" if a.op in ("B", "I") else a.op, a.microbatch, s)] = now
            if a.op == "F" and s < last:
                hop = 0.0 if layout.place(s + 1)[0] == r else p2p
                arrival[("F", a.microbatch, s + 1)] = now + hop
            if a.op in ("B", "I") and s > 0:
                hop = 0.0 if layout.place(s - 1)[0] == r else p2p
                arrival[("B", a.microbatch, s - 1)] = now + hop
            pos[r] += 1
            remaining[r] = None
    return now, work

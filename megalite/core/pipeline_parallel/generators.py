"""The compute order of every schedule, per pipeline rank, as F / B / I / W actions.

    compute = generate("interleaved-1f1b", pp_size=4, num_microbatches=8, num_chunks=2)
    layout = layout_of("interleaved-1f1b", 4, 2)
    lists = with_p2p(compute, layout)          # what the simulator and the timeline read
    programs = p2p_program(compute, layout)    # the same, with the batches the executor posts

Each generator returns ``compute[rank]``; micro-batches enter every chunk in order 0..m-1 and
leave its backward in the same order. Constraints are checked in ``check_schedule`` (one-line
ValueErrors naming the numbers and the fix).

- ``1f1b`` (PipeDream-Flush): ``min(p - r - 1, m)`` warmup forwards, then F/B pairs, then the
  warmup's backwards; rank r holds at most ``min(p - r, m)`` micro-batches.
- ``gpipe``: all forwards, then all backwards in reverse order.
- ``interleaved-1f1b`` (Megatron): ``v`` chunks per rank in the loop layout; the forwards follow
  Megatron's schedule table (groups of ``g`` micro-batches per chunk, ``p <= g <= m``), the
  backwards the same table with the chunks reversed; ``2 (p - r - 1) + (v - 1) g`` warmup
  forwards; the last group must hold 0 or >= p micro-batches (``m % g``), as Megatron requires.
- ``zb-h1`` (zero bubble, Qi et al. 2023): B split into I and W; an event-driven list schedule
  at unit F = I = W cost: an I as soon as it is ready, else an F while fewer than 1F1B's
  ``p - r`` micro-batches are in flight, else a queued W. W fills what would be the bubble.
  Any ``v``: v > 1 is an interleaved zero-bubble schedule holding ``v p`` chunk-micro-batches
  (1F1B's memory), whose bubble beats interleaved 1F1B's (a heuristic, not a closed form).
- ``zbv``: the same list scheduling over the V layout (two chunks per rank), at most ``2p``
  chunk-micro-batches in flight: 1F1B's peak activation memory on every rank.
- ``dualpipev`` (DeepSeek's DualPipeV, V layout): the 8 phases of the published schedule; each
  overlapped "F of one chunk with B of the other" pair runs as F then B here. ``m >= 2p``.
"""

from __future__ import annotations

from megalite.core.pipeline_parallel.actions import Action, StageLayout

SCHEDULES = ("1f1b", "gpipe", "interleaved-1f1b", "zb-h1", "zbv", "dualpipev")
V_SHAPED = ("zbv", "dualpipev")


def layout_of(schedule: str, pp_size: int, num_chunks: int = 1) -> StageLayout:
    if schedule in V_SHAPED:
        return StageLayout(pp_size, 2, "v")
    return StageLayout(pp_size, num_chunks, "loop")


def check_schedule(
    schedule: str,
    *,
    pp_size: int,
    num_microbatches: int,
    num_chunks: int = 1,
    microbatch_group_size: int | None = None,
) -> None:
    """One-line ValueError when ``schedule`` cannot run this layout. Messages name the config
    fields the values come from (``pipeline_schedule``, ``num_virtual_stages_per_pipeline_rank``,
    ...): the flag layer writes them as flags."""
    p, m, v = pp_size, num_microbatches, num_chunks
    if schedule not in SCHEDULES:
        raise ValueError(
            f"pipeline_schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}"
        )
    if m < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {m}")
    if schedule in ("1f1b", "gpipe") and v != 1:
        raise ValueError(
            f"pipeline_schedule {schedule} runs one model chunk per rank, got {v} virtual "
            "stages; use interleaved-1f1b (or zb-h1) with num_virtual_stages_per_pipeline_rank"
        )
    if schedule == "interleaved-1f1b":
        if v < 2:
            raise ValueError(
                "pipeline_schedule interleaved-1f1b needs num_virtual_stages_per_pipeline_rank"
                f" >= 2 (or num_layers_per_virtual_pipeline_stage), got {v}; use 1f1b for one"
            )
        g = p if microbatch_group_size is None else microbatch_group_size
        if not p <= g <= m:
            raise ValueError(
                f"microbatch_group_size_per_virtual_pipeline_stage {g} must lie in [pp {p}, "
                f"num_microbatches {m}] for the interleaved schedule; raise the global batch "
                "size or lower the group size"
            )
        if 0 < m % g < p:
            raise ValueError(
                f"num_microbatches {m} leaves a last group of {m % g} < pp {p} micro-batches with "
                f"microbatch_group_size_per_virtual_pipeline_stage {g} (the interleaved "
                "schedule would wait on itself); make num_microbatches a multiple of the group "
                "size, or the remainder >= pp (e.g. group size = num_microbatches)"
            )
    if schedule in V_SHAPED and v != 2:
        raise ValueError(
            f"pipeline_schedule {schedule} holds exactly 2 chunks per rank in a V, got "
            f"num_virtual_stages_per_pipeline_rank {v}; leave it unset or set it to 2"
        )
    if schedule == "dualpipev" and m < 2 * p:
        raise ValueError(
            f"pipeline_schedule dualpipev needs num_microbatches >= 2 x pp = {2 * p}, got {m};"
            " raise global_batch_size or lower micro_batch_size"
        )
    if p < 2 and schedule != "1f1b":
        raise ValueError(
            f"pipeline_schedule {schedule} needs pipeline_model_parallel_size >= 2, got {p}"
        )


def generate(
    schedule: str,
    *,
    pp_size: int,
    num_microbatches: int,
    num_chunks: int = 1,
    microbatch_group_size: int | None = None,
    forward_only: bool = False,
) -> list[list[Action]]:
    """``compute[rank]``: the F / B / I / W order of each pipeline rank."""
    if schedule in V_SHAPED:
        num_chunks = 2
    check_schedule(
        schedule,
        pp_size=pp_size,
        num_microbatches=num_microbatches,
        num_chunks=num_chunks,
        microbatch_group_size=microbatch_group_size,
    )
    p, m = pp_size, num_microbatches
    layout = layout_of(schedule, p, num_chunks)
    if forward_only:
        return [forward_order(layout, rank, m) for rank in range(p)]
    if schedule == "1f1b":
        return [one_f_one_b(p, rank, m) for rank in range(p)]
    if schedule == "gpipe":
        return [gpipe(rank, m) for rank in range(p)]
    if schedule == "interleaved-1f1b":
        g = p if microbatch_group_size is None else microbatch_group_size
        return [interleaved(p, rank, m, num_chunks, g) for rank in range(p)]
    if schedule == "dualpipev":
        return [dualpipev(p, rank, m) for rank in range(p)]
    if schedule == "zbv":
        return list_schedule(layout, m, [2 * p] * p, max_deferred=[2 * p] * p)
    if num_chunks == 1:  # 1F1B's p - r in flight, at most p - 1 weight grads waiting
        return list_schedule(layout, m, [p - r for r in range(p)], max_deferred=[p - 1] * p)
    vp = num_chunks * p  # interleaved: 1F1B's memory of p whole stages, in chunk units
    return list_schedule(layout, m, [vp] * p, max_deferred=[vp] * p)


def forward_order(layout: StageLayout, rank: int, m: int) -> list[Action]:
    """Evaluation: every micro-batch through this rank's chunks, in stage order."""
    chunks = sorted(range(layout.num_chunks), key=lambda c: layout.stage(rank, c))
    return [Action("F", i, c) for i in range(m) for c in chunks]


def one_f_one_b(p: int, r: int, m: int) -> list[Action]:
    # warmup: stage r runs forwards until the first backward can reach it
    num_warmup = min(p - r - 1, m)
    out = [Action("F", i) for i in range(num_warmup)]
    # steady state: one forward, one backward
    for i in range(m - num_warmup):
        out += [Action("F", num_warmup + i), Action("B", i)]
    # cooldown: the warmup's backwards
    out += [Action("B", i) for i in range(m - num_warmup, m)]
    return out


def gpipe(r: int, m: int) -> list[Action]:
    del r
    return [Action("F", i) for i in range(m)] + [Action("B", i) for i in reversed(range(m))]


def schedule_table(m: int, v: int, g: int) -> list[tuple[int, int]]:
    """Megatron's forward order of (micro-batch, chunk): ``g`` micro-batches through chunk 0,
    the same through chunk 1, ...; the last group takes whatever micro-batches remain."""
    table = []
    for lo in range(0, m, g):
        hi = m if lo + g >= m else lo + g
        table += [(i, c) for c in range(v) for i in range(lo, hi)]
    return table


def _interleaved_warmup(p: int, r: int, m: int, v: int, g: int) -> int:
    return min((p - r - 1) * 2 + (v - 1) * g, m * v)


def interleaved(p: int, r: int, m: int, v: int, g: int) -> list[Action]:
    table = schedule_table(m, v, g)
    fwd = [Action("F", i, c) for i, c in table]
    bwd = [Action("B", i, v - 1 - c) for i, c in table]
    # warmup: 2 (p - r - 1) + (v - 1) g forwards (all of them when fewer)
    num_warmup = _interleaved_warmup(p, r, m, v, g)
    out = fwd[:num_warmup]
    # steady state: one forward, one backward
    for k in range(m * v - num_warmup):
        out += [fwd[num_warmup + k], bwd[k]]
    # cooldown
    out += bwd[m * v - num_warmup :]
    return out


def list_schedule(
    layout: StageLayout, m: int, limits: list[int], *, max_deferred: list[int] | None = None
) -> list[list[Action]]:
    """Zero-bubble order by event-driven list scheduling at unit F = I = W cost (p2p free).

    A rank that is free picks: the ready I of the oldest micro-batch (the deepest stage first);
    else the ready F of its deepest stage (oldest micro-batch first) while fewer than
    ``limits[rank]`` chunk-micro-batches are in flight (forward done, W not yet); else the oldest
    queued W; else it waits for the next completion."""
    p, S = layout.pp_size, layout.num_stages
    f_done: dict[tuple[int, int], int] = {}  # (mb, stage) -> end time
    i_done: dict[tuple[int, int], int] = {}
    next_f = [[0] * layout.num_chunks for _ in range(p)]
    next_i = [[0] * layout.num_chunks for _ in range(p)]
    w_queue: list[list[tuple[int, int]]] = [[] for _ in range(p)]
    in_flight = [0] * p
    free_at = [0] * p
    out: list[list[Action]] = [[] for _ in range(p)]
    total = 3 * m * S
    done = 0
    t = 0
    relax = False  # set when every rank is idle and blocked by its limit: let an F through
    while done < total:
        chose = False
        for r in range(p):
            if free_at[r] > t:
                continue
            choice = None
            ready_i = []
            for c in range(layout.num_chunks):
                i, s = next_i[r][c], layout.stage(r, c)
                if i < m and (i, s) in f_done and f_done[(i, s)] <= t:
                    if s == S - 1 or i_done.get((i, s + 1), t + 1) <= t:
                        ready_i.append((i, -s, c))
            if ready_i:
                i, _, c = min(ready_i)
                choice = Action("I", i, c)
                next_i[r][c] += 1
                i_done[(i, layout.stage(r, c))] = t + 1
                w_queue[r].append((i, c))
                in_flight[r] -= 1
            backlog = max_deferred is not None and len(w_queue[r]) > max_deferred[r]
            if choice is None and (relax or (not backlog and in_flight[r] < limits[r])):
                ready_f = []
                for c in range(layout.num_chunks):
                    i, s = next_f[r][c], layout.stage(r, c)
                    if i < m and (s == 0 or f_done.get((i, s - 1), t + 1) <= t):
                        ready_f.append((-s, i, c))
                if ready_f:
                    _, i, c = min(ready_f)
                    choice = Action("F", i, c)
                    next_f[r][c] += 1
                    f_done[(i, layout.stage(r, c))] = t + 1
                    in_flight[r] += 1
            if choice is None and w_queue[r]:
                i, c = w_queue[r].pop(0)
                choice = Action("W", i, c)
            if choice is not None:
                out[r].append(choice)
                free_at[r] = t + 1
                done += 1
                chose = True
        if not chose and all(f <= t for f in free_at) and not relax:
            relax = True  # retry this instant without the limits
            continue
        relax = False
        t += 1
        if t > 10 * total + 10:
            raise RuntimeError("list scheduling made no progress (limits too small?)")
    return out


def dualpipev(p: int, r: int, m: int) -> list[Action]:
    """DualPipeV's published order for rank r (chunk 0 = stage r, chunk 1 = stage 2p - 1 - r).
    ``B`` with zero bubble on is an I whose W goes to a queue that ``W`` pops in order."""
    out: list[Action] = []
    nxt = {"F0": 0, "F1": 0, "B0": 0, "B1": 0}
    w_queue: list[tuple[int, int]] = []

    def f(c):
        out.append(Action("F", nxt[f"F{c}"], c))
        nxt[f"F{c}"] += 1

    def b(c, zb=False):
        i = nxt[f"B{c}"]
        nxt[f"B{c}"] += 1
        if zb:
            out.append(Action("I", i, c))
            w_queue.append((i, c))
        else:
            out.append(Action("B", i, c))

    def w():
        i, c = w_queue.pop(0)
        out.append(Action("W", i, c))

    for _ in range((p - r - 1) * 2):  # 1: chunk 0 forwards
        f(0)
    for _ in range(r + 1):  # 2: chunk 0 and chunk 1 forwards, alternating
        f(0)
        f(1)
    for _ in range(p - r - 1):  # 3: B1 (zero bubble), W, F1
        b(1, zb=True)
        w()
        f(1)
    for _ in range(m - 2 * p + r + 1):  # 4: main: F0 with B1, F1 with B0
        f(0)
        b(1)
        f(1)
        b(0)
    for _ in range(p - r - 1):  # 5: B1, then F1 with B0
        b(1)
        f(1)
        b(0)
    zb = False
    steps = r + 1
    for i in range(steps):  # 6: B1 B0; the second half with zero bubble
        if i == steps // 2 and r % 2 == 1:
            zb = True
        b(1, zb)
        if i == steps // 2 and r % 2 == 0:
            zb = True
        b(0, zb)
    for _ in range(p - r - 1):  # 7: W, B0 (zero bubble)
        w()
        b(0, zb=True)
    while w_queue:  # 8: the remaining W
        w()
    return out

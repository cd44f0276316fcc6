"""The in-flight activations of a pipeline rank, replayed from its schedule's action list.

lists = schedule_lists("1f1b", pp=4, m=8, vp=1, group=None)   # one tuple per pipeline rank
peak, most = replay_peak(lists[rank], held=[...], transient=[...])
"""

from __future__ import annotations

import functools

from megalite.core.pipeline_parallel.generators import generate, layout_of


def replay_peak(actions, held: list[int], transient: list[int]) -> tuple[int, int]:
    """Walk one rank's action list (``pipeline_parallel.generators``): a forward of chunk ``c``
    adds ``held[c]`` bytes until its backward (B, or I: the saved-tensor graph is freed there;
    what W keeps is the weight-grad store's, not autograd's), whose own peak is the bytes held
    less its micro-batch's plus ``transient[c]`` (recompute). The order alone decides the peak.
    Returns (peak bytes, the most chunk-micro-batches held)."""
    live = peak = count = most = 0
    for a in actions:
        if a.op == "F":
            live += held[a.chunk]
            count += 1
            peak, most = max(peak, live), max(most, count)
        elif a.op in ("B", "I"):
            peak = max(peak, live - held[a.chunk] + transient[a.chunk])
            live -= held[a.chunk]
            count -= 1
    return peak, most


@functools.lru_cache(maxsize=512)
def schedule_lists(schedule: str, pp: int, m: int, vp: int, group: int | None) -> tuple:
    """The schedule's compute actions, one tuple per pipeline rank (``generators.generate``):
    the same for every layout of this shape, so built once (the planner's search asks for them
    thousands of times; callers only read them)."""
    chunks = layout_of(schedule, pp, vp).num_chunks
    lists = generate(
        schedule, pp_size=pp, num_microbatches=m, num_chunks=chunks, microbatch_group_size=group
    )
    return tuple(tuple(rank) for rank in lists)

"""Simulator costs read off a profiling step's own ``Timeline`` spans (one step of every rank).

costs = costs_from_spans(spans, p2p=latency, steps=steps, num_actions=lengths)
simulate(lists, layout, costs)
"""

from __future__ import annotations

from megalite.core.pipeline_parallel.simulator import Costs


def costs_from_spans(
    spans: list[list[tuple[str, float, float]]],
    *,
    p2p: float = 0.0,
    steps: list[tuple[float, float]] | None = None,
    num_actions: list[int] | None = None,
) -> Costs:
    """``Costs`` measured by a profiling step: the mean duration of the ``forward``,
    ``backward-input`` and ``backward-weight`` spans of every rank's ``Timeline`` (a ZB-H1 step
    has all three; a step with fused ``backward`` spans gives I = W = B / 2). ``p2p``: the
    latency of one activation between neighbours, measured apart (e.g. half a ping-pong).
    ``steps`` (each rank's (start, end) of the step) and ``num_actions`` (the length of each
    rank's list): the time outside every span (compute and receive waits) per action is the
    executor's own overhead, ``per_action`` (the mean over ranks)."""
    per_action = 0.0
    if steps is not None and num_actions is not None:
        outside = [
            (end - start - sum(e - s for _, s, e in rank_spans)) / max(n, 1)
            for rank_spans, (start, end), n in zip(spans, steps, num_actions)
        ]
        per_action = max(0.0, sum(outside) / len(outside))
    times: dict[str, list[float]] = {}
    for rank_spans in spans:
        for label, start, end in rank_spans:
            times.setdefault(label.split()[0], []).append(end - start)

    def mean(kind: str) -> float | None:
        values = times.get(kind)
        return sum(values) / len(values) if values else None

    forward = mean("forward")
    if forward is None:
        raise ValueError("the profiling spans hold no forward span: record a Timeline step")
    i, w = mean("backward-input"), mean("backward-weight")
    if i is None or w is None:
        b = mean("backward")
        if b is None:
            raise ValueError("the profiling spans hold no backward span")
        i = w = b / 2
    return Costs(forward, i, w, p2p=p2p, per_action=per_action)

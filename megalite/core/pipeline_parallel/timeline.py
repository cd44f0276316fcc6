"""Per-stage timestamps of one pipeline step (forward, backward, send, recv), for pictures.

A schedule given a ``Timeline`` records a span for each compute and communication call; idle time is
what lies between spans. ``tools/pipeline_timeline.py`` turns the spans of every stage into an SVG;
``render_comparison_svg`` draws the simulator's predicted spans (``Simulation.spans``) above the
measured ones on one time axis (``tools/bench/bench_pipeline_sim.py --timeline-dir``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from html import escape

# what a compute action's span is called: "<kind> <micro-batch>.<chunk>" (``span_label``)
LABELS = {"F": "forward", "B": "backward", "I": "backward-input", "W": "backward-weight"}


def span_label(op: str, microbatch: int, chunk: int) -> str:
    """The label of compute action ``op`` (F, B, I or W) of ``microbatch`` on ``chunk``."""
    return f"{LABELS[op]} {microbatch}.{chunk}"


class _Span:
    """One span being timed: a slotted object, not a generator, so that the executor's spans
    (one per action when it is measured) cost as little as two clock reads allow and stay out of
    the executor's own cost they help measure."""

    __slots__ = ("spans", "clock", "label", "start")

    def __init__(self, spans: list, clock: Callable[[], float], label: str) -> None:
        self.spans, self.clock, self.label = spans, clock, label

    def __enter__(self) -> None:
        self.start = self.clock()

    def __exit__(self, *exc) -> None:
        self.spans.append((self.label, self.start, self.clock()))


class Timeline:
    """Spans read on ``clock``: wall time by default; ``time.thread_time`` gives the main thread's
    CPU time in each span (``profiling.executor_seconds_per_action``)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.spans: list[tuple[str, float, float]] = []  # (label, start, end), seconds of clock

    def span(self, label: str) -> _Span:
        """``with timeline.span(label): ...`` records ``(label, start, end)`` on exit, also when
        the body raises."""
        return _Span(self.spans, self.clock, label)

    def busy_seconds(self, labels: tuple[str, ...] = ("forward", "backward")) -> float:
        return sum(end - start for label, start, end in self.spans if label.split()[0] in labels)


# forward / input grad / weight grad; chunk 1 of a rank in a darker shade
_COLOURS = {
    "forward": ("#4c78a8", "#2a4a75"),
    "backward": ("#f58518", "#b35c00"),
    "backward-input": ("#f58518", "#b35c00"),
    "backward-weight": ("#54a24b", "#2f6b28"),
    "recv": ("#d3c4dc", "#d3c4dc"),
}
_ROW, _GAP, _LEFT, _WIDTH = 22, 4, 96, 1100


def render_comparison_svg(
    predicted: list[list[tuple[str, float, float]]],
    measured: list[list[tuple[str, float, float]]],
    title: str = "",
) -> str:
    """SVG text: the predicted timeline (a row per rank) above the measured one, one time axis
    from 0 (spans in seconds from the step's start). A span is labelled ``kind mb.chunk``;
    forward blue, input grad (or whole backward) orange, weight grad green, receive waits pale."""
    panels = [("predicted", predicted), ("measured", measured)]
    t1 = max((e for _, rows in panels for spans in rows for _, _, e in spans), default=1e-9)
    scale = _WIDTH / max(t1, 1e-9)
    p = max(len(predicted), len(measured))
    height = 40 + 2 * (24 + p * (_ROW + _GAP)) + 46
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_LEFT + _WIDTH + 20}" '
        f'height="{height}" font-family="sans-serif" font-size="11">',
        f'<text x="{_LEFT}" y="18" font-size="14">{escape(title)}</text>',
    ]
    y = 30
    for name, rows in panels:
        end = max((e for spans in rows for _, _, e in spans), default=0.0)
        out.append(f'<text x="4" y="{y + 14}" font-weight="bold">{name}: {end * 1e3:.1f} ms</text>')
        y += 20
        for r, spans in enumerate(rows):
            out.append(f'<text x="4" y="{y + _ROW * 0.7}">rank {r}</text>')
            out.append(
                f'<rect x="{_LEFT}" y="{y}" width="{_WIDTH}" height="{_ROW}" fill="#f2f2f2"/>'
            )
            for label, s, e in spans:
                kind, _, ids = label.partition(" ")
                chunk = int(ids.split(".")[1]) if "." in ids else 0
                colour = _COLOURS.get(kind, ("#9d9d9d",) * 2)[min(chunk, 1)]
                x, w = _LEFT + s * scale, max((e - s) * scale, 0.5)
                out.append(
                    f'<rect x="{x:.2f}" y="{y}" width="{w:.2f}" height="{_ROW}" fill="{colour}" '
                    f'stroke="white" stroke-width="0.3"><title>{escape(label)} '
                    f"{(e - s) * 1e3:.2f} ms</title></rect>"
                )
                if w > 14 and kind != "recv":
                    out.append(
                        f'<text x="{x + w / 2:.2f}" y="{y + _ROW * 0.7}" fill="white" '
                        f'text-anchor="middle" font-size="9">{escape(ids.split(".")[0])}</text>'
                    )
            y += _ROW + _GAP
        y += 4
    legend = [
        ("forward", "#4c78a8"),
        ("input grad / backward", "#f58518"),
        ("weight grad", "#54a24b"),
        ("receive wait", "#d3c4dc"),
        ("idle", "#f2f2f2"),
    ]
    for j, (name, colour) in enumerate(legend):
        x = _LEFT + j * 170
        out.append(
            f'<rect x="{x}" y="{y + 4}" width="12" height="12" fill="{colour}" stroke="#999"/>'
        )
        out.append(f'<text x="{x + 16}" y="{y + 14}">{name}</text>')
    note = "darker: a rank's second chunk; number: micro-batch"
    out.append(f'<text x="{_LEFT}" y="{y + 32}">{escape(note)}</text>')
    out.append("</svg>")
    return "\n".join(out)

"""Per-stage timestamps of one pipeline step (forward, backward, send, recv), for pictures.

A schedule given a ``Timeline`` records a span for each compute and communication call; idle time is
what lies between spans. ``tools/pipeline_timeline.py`` turns the spans of every stage into an SVG.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator


class Timeline:
    def __init__(self) -> None:
        self.spans: list[tuple[str, float, float]] = []  # (label, start, end), perf_counter seconds

    @contextlib.contextmanager
    def span(self, label: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.spans.append((label, start, time.perf_counter()))

    def busy_seconds(self, labels: tuple[str, ...] = ("forward", "backward")) -> float:
        return sum(end - start for label, start, end in self.spans if label.split()[0] in labels)

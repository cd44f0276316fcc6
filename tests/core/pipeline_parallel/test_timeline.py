"""``Timeline.span``: one (label, start, end) per span, in the order the spans end, read on the
timeline's clock exactly twice; a body that raises still leaves its span (the error passes on)."""

from __future__ import annotations

import pytest

from megalite.core.pipeline_parallel.timeline import Timeline


class Ticks:
    """A clock that returns 0, 1, 2, ... and counts its reads."""

    def __init__(self) -> None:
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        return float(self.reads - 1)


def test_spans_nest_in_the_order_they_end_and_read_the_clock_twice_each():
    clock = Ticks()
    timeline = Timeline(clock=clock)
    with timeline.span("forward 0.0"):
        with timeline.span("recv"):
            pass
    with timeline.span("backward 0.0"):
        pass
    assert timeline.spans == [
        ("recv", 1.0, 2.0),
        ("forward 0.0", 0.0, 3.0),
        ("backward 0.0", 4.0, 5.0),
    ]
    assert clock.reads == 6
    assert timeline.busy_seconds() == 3.0 + 1.0


def test_a_span_whose_body_raises_is_recorded_and_the_error_passes_on():
    timeline = Timeline(clock=Ticks())
    with pytest.raises(RuntimeError, match="the body failed"):
        with timeline.span("forward 1.0"):
            raise RuntimeError("the body failed")
    assert timeline.spans == [("forward 1.0", 0.0, 1.0)]

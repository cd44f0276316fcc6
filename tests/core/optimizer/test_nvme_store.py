"""``chunk_spans``: the bounded ranges an NVMe step reads and writes, each spanning many pieces.

Every element of every span lies in exactly one range, each range holds at most ``chunk``
elements and lists exactly the spans it overlaps, and a range between spans (padding) is skipped.
"""

from __future__ import annotations

from megalite.core.optimizer.nvme_store import Span, chunk_spans


def test_chunk_spans_cover_every_span_once_in_bounded_ranges_and_skip_gaps():
    spans = [Span(40, 1), Span(20, 12), Span(5, 3), Span(0, 5)]  # any order; gaps 8-20, 32-40
    got = list(chunk_spans(spans, 6))
    want = [(0, 6), (6, 12), (18, 24), (24, 30), (30, 36), (36, 41)]  # [12, 18): no span
    assert [(lo, hi) for lo, hi, _ in got] == want
    assert [inside for *_, inside in got] == [
        [Span(0, 5), Span(5, 3)],
        [Span(5, 3)],
        [Span(20, 12)],
        [Span(20, 12)],
        [Span(20, 12)],
        [Span(40, 1)],
    ]
    covered = [
        x
        for lo, hi, inside in got
        for s in inside
        for x in range(max(lo, s.start), min(hi, s.start + s.numel))
    ]
    assert sorted(covered) == sorted(x for s in spans for x in range(s.start, s.start + s.numel))
    assert list(chunk_spans([], 6)) == []

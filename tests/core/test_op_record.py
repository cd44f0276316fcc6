"""The op recorder (``op_record.py``) and the report it feeds (``hang_report.py``), in one process:
records made by hand on two recorders stand for two ranks. What is checked: off records nothing;
a collective inside a pipeline action takes the action's stage, micro-batch and action; sequence
numbers count per channel (a group, or one direction between two ranks) beyond the ring's
capacity; ``current`` follows begin / wait / end; and the report names the first divergence of
a skipped message, of two different collectives, and of a dead peer.
"""

from __future__ import annotations

import json

from megalite.core.hang_report import explain, first_divergence
from megalite.core.hang_watchdog import HangWatchdog
from megalite.core.op_record import OpRecorder


def test_off_records_nothing():
    rec = OpRecorder()
    assert rec.begin("all_reduce", what="x", shape=(4,)) is None
    assert rec.post("send", peer=1, shape=(4,)) is None
    rec.wait(None)
    rec.end(None)
    assert rec.ring == [] and rec.count == 0 and rec.current is None


def test_context_sequence_numbers_and_current():
    rec = OpRecorder()
    rec.enable(capacity=4, rank=0)
    f = rec.begin("compute", stage=1, microbatch=5, action="B", chunk=0)
    assert rec.current is f
    ar = rec.begin("all_reduce", what="grad bucket 0.0", shape=(8,))
    assert rec.current is ar and (ar.stage, ar.microbatch, ar.action) == (1, 5, "B")
    rec.end(ar)
    assert rec.current is f
    sends = [rec.post("send", peer=1, microbatch=m, what="activation") for m in range(3)]
    recv = rec.post("recv", peer=1, microbatch=0, what="grad")
    assert [s.seq for s in sends] == [0, 1, 2] and recv.seq == 0  # one counter per direction
    assert rec.current is f  # posted, not waited on
    rec.wait(recv)
    assert rec.current is recv and recv.state == "waiting"
    rec.end(recv)
    rec.end(f)
    assert rec.current is None
    assert rec.count == 6 and [r.index for r in rec.records()] == [2, 3, 4, 5]  # the last 4
    snap = json.loads(json.dumps(rec.snapshot()))
    assert ["p2p", 0, 1] in [c for c, _ in snap["counters"]]
    assert dict((tuple(c), n) for c, n in snap["counters"])[("p2p", 0, 1)] == 3


def _ranks():
    a, b = OpRecorder(), OpRecorder()
    a.enable(rank=0)
    b.enable(rank=1)
    a.coords["pp"], b.coords["pp"] = 0, 1
    return a, b


def test_a_skipped_send_is_the_first_divergence():
    a, b = _ranks()
    for m in (0, 2):  # rank 0 skips micro-batch 1
        a.post("send", peer=1, microbatch=m, stage=1, action="F", what="activation")
    recvs = [b.post("recv", peer=0, microbatch=m, stage=1, action="F", what="activation")
             for m in (0, 1)]  # fmt: skip
    b.end(recvs[0])
    b.wait(recvs[1])
    lines = explain({0: a.snapshot(), 1: b.snapshot()}, world_size=2)
    assert lines[2].startswith(
        "rank 1 (pp stage 1) waits to receive micro-batch 1's activation (stage 1) from rank 0"
    ), lines
    assert lines[-1] == (
        "first divergence: rank 0's send #1 to rank 1 is micro-batch 2's activation (stage 1), "
        "but rank 1's receive #1 from rank 0 expects micro-batch 1's activation (stage 1)"
    )


def test_different_collectives_and_a_dead_peer():
    a, b = _ranks()
    for r in (a, b):  # no process group in this test: the channel of a 2-rank group, by hand
        r._group_keys[id(None)] = (None, ("group", "1", 0, 1))
    a.begin("all_reduce", axis="dp", what="grad bucket 0.0", shape=(72,))
    b.begin("all_reduce", axis="dp", what="grad bucket 0.1", shape=(64,))
    got = first_divergence({0: a.snapshot(), 1: b.snapshot()})
    assert got.startswith(
        "the ranks disagree: rank 0 entered all_reduce #0 over dp ranks [0, 1] "
    ), got
    assert "grad bucket 0.1, shape [64]" in got, got
    a, _ = _ranks()
    a.wait(a.post("recv", peer=1, microbatch=3, stage=0, action="B", what="grad"))
    lines = explain({0: a.snapshot(), 1: None}, world_size=2, grace_s=5)
    assert lines[1].endswith("which published nothing (dead?)"), lines
    assert lines[2].startswith("rank 1 published nothing within 5 s"), lines
    assert lines[-1] == (
        "first divergence: rank 0 (pp stage 0) waits for micro-batch 3's gradient (stage 0) (#0 "
        "from rank 1 to rank 0), and rank 1 published nothing (dead?)"
    )


class _DeadStore:
    def add(self, key, n):
        raise RuntimeError("connection refused")


def test_a_failed_store_still_reports_this_rank_and_exits():
    rec, _ = _ranks()
    rec.wait(rec.post("recv", peer=1, microbatch=2, stage=0, action="B", what="grad"))
    lines, codes = [], []
    watchdog = HangWatchdog(
        rec,
        timeout_s=1,
        store=_DeadStore(),
        rank=0,
        world_size=2,
        write=lines.extend,
        exit_fn=codes.append,
    )
    watchdog.trigger("rank 0 was in one operation for 2 s")
    assert codes == [1], codes
    assert "the store failed (connection refused)" in lines[0], lines
    assert lines[1].startswith("rank 0 (pp stage 0) waits to receive micro-batch 2's gradient"), (
        lines
    )
    assert lines[2].startswith("rank 1 published nothing"), lines


def test_a_group_key_cached_for_a_dead_group_is_not_reused_by_a_new_one():
    (a, _) = _ranks()
    # the entry of a group that was freed, whose id the next group (here: None) now has
    a._group_keys[id(None)] = (object(), ("group", "dead", 0, 1))
    assert a._channel("all_reduce", None, None) == ("group", "")
    a.enable(4, rank=0)
    assert a._group_keys == {}

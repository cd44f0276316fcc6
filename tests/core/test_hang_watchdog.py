"""The hang explainer end to end, by fault injection on gloo (``hang_case.py``): two ranks, the op
recorder and the watchdog on with a 10 s timeout, one fault each. Every case asserts the exit code
(1 on every rank: the watchdog ended the job; a job it never ended is killed at the hang guard,
timeout + 600 s, and exits -9), and the report's lines: who waits for whom, naming stage,
micro-batch and action, and the first divergence. How long after the watchdogs started each job
ended is printed (``pytest -s``), not asserted: on a loaded machine that is the machine's speed.

The ranks are processes of the harness's fork server (torch and megalite already imported), each
writing its output to a file; they are not the harness's pool, since they are meant to die.
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from pathlib import Path

from tests.core import hang_case
from tests.harness import _context

TIMEOUT_S = 10.0  # long enough that a slow (loaded) machine does not look hung before the fault


def _rank(fault: str, rank: int, world_size: int, init_file: str, out: str) -> None:
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    hang_case.main(fault, rank, world_size, init_file, TIMEOUT_S)


def _run(fault: str, world_size: int = 2) -> tuple[list[int], str]:
    """Every rank's exit code and the ranks' output joined."""
    ctx = _context()
    with tempfile.TemporaryDirectory(prefix="megalite-hang-") as tmp:
        init_file = str(Path(tmp) / "rendezvous")
        outs = [str(Path(tmp) / f"rank{r}.txt") for r in range(world_size)]
        procs = [
            ctx.Process(target=_rank, args=(fault, r, world_size, init_file, outs[r]))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=TIMEOUT_S + 600)
        ended = time.time()
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        text = "\n".join(Path(o).read_text() for o in outs)
    starts = [float(t) for t in re.findall(r"^watching from ([0-9.]+)$", text, re.M)]
    assert starts, text
    took = ended - max(starts)
    print(
        f"{fault}: the job ended {took:.1f} s after the watchdogs started (timeout {TIMEOUT_S} s)"
    )
    return [p.exitcode for p in procs], text


def _report(text: str) -> list[str]:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("hang explainer:"))
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("first divergence:"))
    return lines[start : end + 1]


def test_a_skipped_send_is_named_with_its_micro_batch():
    codes, text = _run("skip_send")
    assert codes == [1, 1], text
    report = _report(text)
    assert report[1].startswith(
        "rank 0 (pp stage 0) waits to receive micro-batch 1's gradient (stage 0) from rank 1"
    ), report
    assert report[2].startswith(
        "rank 1 (pp stage 1) waits to receive micro-batch 1's activation (stage 1) from rank 0"
    ), report
    assert report[-1] == (
        "first divergence: rank 0's send #1 to rank 1 is micro-batch 2's activation (stage 1), "
        "but rank 1's receive #1 from rank 0 expects micro-batch 1's activation (stage 1)"
    ), report


def test_a_rank_asleep_in_its_forward_is_named_by_the_rank_waiting_for_it():
    codes, text = _run("sleep_forward")
    assert codes == [1, 1], text
    report = _report(text)
    assert re.fullmatch(
        r"rank 0 \(pp stage 0\) waits to receive micro-batch 2's gradient \(stage 0\) from rank 1 "
        r"for \d+ s, which is in the forward of micro-batch 2 \(stage 1\) for \d+ s",
        report[1],
    ), report
    assert re.fullmatch(
        r"rank 1 \(pp stage 1\) is in the forward of micro-batch 2 \(stage 1\) for \d+ s", report[2]
    ), report
    assert re.fullmatch(
        r"first divergence: rank 0 waits for micro-batch 2's gradient \(stage 0\) \(#2 from rank 1 "
        r"to rank 0\), which rank 1 has not sent: rank 1 is in the forward of micro-batch 2 "
        r"\(stage 1\) for \d+ s",
        report[-1],
    ), report


def test_a_dead_rank_is_named_as_such():
    codes, text = _run("die")
    assert codes == [1, 3], text
    report = _report(text)
    assert report[0].startswith("hang explainer: rank 0 failed in a collective"), report
    assert re.fullmatch(
        r"rank 0 \(pp stage 0\) waits to receive micro-batch 2's gradient \(stage 0\) from rank 1 "
        r"for \d+ s, which published nothing \(dead\?\)",
        report[1],
    ), report
    assert report[2].startswith("rank 1 published nothing within 4 s"), report
    assert report[-1] == (
        "first divergence: rank 0 (pp stage 0) waits for micro-batch 2's gradient (stage 0) (#2 "
        "from rank 1 to rank 0), and rank 1 published nothing (dead?)"
    ), report


def test_ranks_in_different_bucket_reductions_are_named_with_their_buckets():
    codes, text = _run("bucket")
    assert codes == [1, 1], text
    report = _report(text)
    assert re.fullmatch(
        r"rank 0 \(pp stage 0\) waits in all_reduce #0 over ranks \[0, 1\] \(loss, shape \[1\]\) "
        r"for \d+ s",
        report[1],
    ), report
    bucket = r"all_reduce #2 over dp ranks \[0, 1\] \(grad bucket 0\.2, shape \[72\]\)"
    assert re.fullmatch(rf"rank 1 \(pp stage 0\) waits in {bucket} for \d+ s", report[2]), report
    # both ranks wait from about the same moment, so either end of the mismatch may come first
    loss = r"all_reduce #0 over ranks \[0, 1\] \(loss, shape \[1\]\)"
    assert re.fullmatch(
        rf"first divergence: rank 1 waits in {bucket}, which rank 0 has not entered: rank 0 "
        rf"waits in {loss} for \d+ s"
        rf"|first divergence: rank 0 waits in {loss}, which rank 1 has not entered: rank 1 "
        rf"waits in {bucket} for \d+ s",
        report[-1],
    ), report

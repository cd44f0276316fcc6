"""tools/gpu_check_report.py: a gpu_check.sh step is ok only when it ran a test and none failed.

The step results are written here as gpu_check.sh writes them (JUnit XML from pytest, bench_mfu's
JSON, a benchmark's log), so each rule is checked without a GPU.
"""

from __future__ import annotations

import json
from pathlib import Path

from tools import gpu_check_report as report


def _junit(path: Path, *, tests: int, failures: int = 0, errors: int = 0, skipped: int = 0) -> str:
    path.write_text(
        f'<?xml version="1.0"?><testsuites><testsuite name="pytest" tests="{tests}" '
        f'failures="{failures}" errors="{errors}" skipped="{skipped}"/></testsuites>'
    )
    return str(path)


def _step(kind: str, artifacts: list[str], code: str = "0") -> report.Step:
    return report.judge(report.Step("s", kind, 60, code, 12, artifacts))


def test_pytest_steps_count_what_ran(tmp_path):
    ok = _step("pytest", [_junit(tmp_path / "a.xml", tests=5, skipped=1)])
    assert (ok.status, ok.run, ok.failed, ok.skipped) == ("ok", 4, 0, 1)
    # one step, several processes: the counts add up
    a = _junit(tmp_path / "b.xml", tests=3)
    b = _junit(tmp_path / "c.xml", tests=4, failures=1, errors=1)
    both = _step("pytest", [a, b], code="0")
    assert (both.status, both.run, both.failed) == ("FAILED", 7, 2)


def test_a_step_whose_tests_all_skipped_is_not_ok(tmp_path):
    skipped = _step("pytest", [_junit(tmp_path / "a.xml", tests=3, skipped=3)], code="0")
    assert (skipped.status, skipped.run, skipped.skipped) == ("FAILED (ran no test)", 0, 3)
    nothing = _step("pytest", [str(tmp_path / "never-written.xml")], code="1")
    assert nothing.status == "FAILED (ran no test)"


def test_a_step_stopped_at_its_box_is_a_timeout(tmp_path):
    partial = _junit(tmp_path / "a.xml", tests=2)
    for code in ("124", "137"):
        assert _step("pytest", [partial], code=code).status == "TIMEOUT (box 60 s)"


def test_a_nonzero_exit_fails_even_when_the_tests_passed(tmp_path):
    passed = _junit(tmp_path / "a.xml", tests=2)
    assert _step("pytest", [passed], code="3").status == "FAILED (exit 3)"


def test_bench_rows_are_the_tests(tmp_path):
    rows = [{"status": "ok"}, {"status": "ok"}]
    path = tmp_path / "mfu.json"
    path.write_text(json.dumps({"rows": rows}))
    assert _step("bench_json", [str(path)]).status == "ok"
    path.write_text(json.dumps({"rows": [*rows, {"status": "out of memory"}]}))
    oom = _step("bench_json", [str(path)], code="1")
    assert (oom.status, oom.run, oom.failed) == ("FAILED", 3, 1)


def test_table_rows_are_the_tests(tmp_path):
    log = tmp_path / "bench.log"
    log.write_text("device: x\n| case | ms |\n|---|---|\n| a | 1 |\n| b | 2 |\n")
    assert (_step("table", [str(log)]).status, _step("table", [str(log)]).run) == ("ok", 2)
    assert _step("table", [str(log)], code="1").status == "FAILED"


def test_the_report_and_its_exit_status(tmp_path):
    good = _junit(tmp_path / "a.xml", tests=2)
    bad = _junit(tmp_path / "b.xml", tests=2, failures=1)
    tsv = tmp_path / "steps.tsv"
    head = "H100 80GB HBM3\t2.11.0+cu130\tquick\n"
    tsv.write_text(head + f"one\tpytest\t90\t0\t30\t{good}\n")
    assert report.main([str(tsv), str(tmp_path)]) == 0
    tsv.write_text(head + f"one\tpytest\t90\t0\t30\t{good}\ntwo\tpytest\t40\t0\t9\t{bad}\n")
    assert report.main([str(tsv), str(tmp_path)]) == 1
    table = (tmp_path / "gpu_check.md").read_text()
    assert "H100 80GB HBM3, torch 2.11.0+cu130 (time boxes sum to 130 s)" in table
    assert "| one | ok | 2 | 0 | 0 | 30 | 90 |" in table and "| two | FAILED | 2 | 1 |" in table
    saved = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [s["status"] for s in saved["steps"]] == ["ok", "FAILED"]
    # no GPU: every step skipped is exit 0, but never "ok"
    tsv.write_text("no CUDA GPU\t2.11.0\tquick\none\t-\t90\tskipped\t0\t-\n")
    assert report.main([str(tsv), str(tmp_path)]) == 0
    assert (
        "| one | skipped (no GPU) | - | - | - | - | 90 |" in (tmp_path / "gpu_check.md").read_text()
    )

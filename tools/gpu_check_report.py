"""The table of a ``scripts/gpu_check.sh`` run: each step's status from what it ran, not its exit.

    python tools/gpu_check_report.py STEPS_TSV OUT_DIR     # writes OUT_DIR/gpu_check.{md,json}

``STEPS_TSV`` (written by gpu_check.sh) has a header line ``device<TAB>torch<TAB>mode`` and then
one line per step: ``name<TAB>kind<TAB>box_s<TAB>exit_code<TAB>seconds<TAB>artifacts`` where
``kind`` says how the step's tests are counted and ``artifacts`` are files (comma-separated):

- ``pytest``: JUnit XML files (one per process of the step): run = tests - skipped;
- ``bench_json``: bench_mfu.py's JSON: each (model, kind) row is a test, failed unless "ok";
- ``table``: a log whose markdown rows (``| ...``, less the header) are the tests; all failed
  when the exit code is not 0.

Status: ``ok`` only when the step ran at least one test and none failed; ``TIMEOUT`` when its box
ran out (exit 124 or 137 from ``timeout``); ``FAILED`` otherwise, with why. Exit code
``skipped`` (no CUDA under ``--allow-no-gpu``) gives ``skipped (no GPU)``, never ok.
Exit status: 0 when every step is ok, or every step was skipped for want of a GPU; else 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path

NO_GPU = "skipped (no GPU)"
TIMEOUT_CODES = {"124", "137"}  # timeout's own code, and KILL after the grace period


@dataclass
class Step:
    name: str
    kind: str
    box_s: int
    exit_code: str
    seconds: int
    artifacts: list[str]
    status: str = ""
    run: int | None = None
    failed: int | None = None
    skipped: int | None = None
    figures: dict = field(default_factory=dict)


def count_junit(paths: list[str]) -> tuple[int, int, int]:
    """(run, failed, skipped) over JUnit XML files; a missing file counts nothing."""
    run = failed = skipped = 0
    for path in paths:
        if not Path(path).is_file():
            continue
        root = ET.parse(path).getroot()
        for suite in [root] if root.tag == "testsuite" else root.iter("testsuite"):
            tests, skips = int(suite.get("tests", 0)), int(suite.get("skipped", 0))
            run += tests - skips
            skipped += skips
            failed += int(suite.get("failures", 0)) + int(suite.get("errors", 0))
    return run, failed, skipped


def count_bench(path: str) -> tuple[int, int, dict]:
    """(rows measured, rows failed, the report) of bench_mfu.py's JSON."""
    if not Path(path).is_file():
        return 0, 0, {}
    report = json.loads(Path(path).read_text())
    rows = report.get("rows", [])
    return len(rows), sum(r.get("status") != "ok" for r in rows), report


def count_table(path: str, exit_code: str) -> tuple[int, int]:
    """(markdown rows, rows failed) of a benchmark's log: all failed on a non-zero exit."""
    if not Path(path).is_file():
        return 0, 0
    rows = [line for line in Path(path).read_text().splitlines() if line.startswith("| ")]
    run = max(len(rows) - 1, 0)  # less the header line
    return run, run if exit_code != "0" else 0


def judge(step: Step) -> Step:
    """Fill in the counts and the status of a step."""
    if step.exit_code == "skipped":
        step.status = NO_GPU
        return step
    if step.kind == "pytest":
        step.run, step.failed, step.skipped = count_junit(step.artifacts)
    elif step.kind == "bench_json":
        step.run, step.failed, step.figures = count_bench(step.artifacts[0])
        step.skipped = 0
    else:
        step.run, step.failed = count_table(step.artifacts[0], step.exit_code)
        step.skipped = 0
    if step.exit_code in TIMEOUT_CODES:
        step.status = f"TIMEOUT (box {step.box_s} s)"
    elif step.failed:
        step.status = "FAILED"
    elif step.run == 0:
        step.status = "FAILED (ran no test)"
    elif step.exit_code != "0":
        step.status = f"FAILED (exit {step.exit_code})"
    else:
        step.status = "ok"
    return step


def read_steps(path: Path) -> tuple[dict, list[Step]]:
    lines = path.read_text().splitlines()
    device, torch_version, mode = lines[0].split("\t")
    steps = []
    for line in lines[1:]:
        name, kind, box, code, seconds, artifacts = line.split("\t")
        steps.append(Step(name, kind, int(box), code, int(seconds), artifacts.split(",")))
    return {"device": device, "torch": torch_version, "mode": mode}, steps


def _cell(value) -> str:
    return "-" if value is None else str(value)


def markdown(header: dict, steps: list[Step]) -> list[str]:
    boxes = sum(s.box_s for s in steps)
    lines = [
        f"gpu_check {header['mode']}: {header['device']}, torch {header['torch']} "
        f"(time boxes sum to {boxes} s)",
        "",
        "| step | status | tests run | failed | skipped | seconds | box s |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in steps:
        seconds = "-" if s.status == NO_GPU else s.seconds
        lines.append(
            f"| {s.name} | {s.status} | {_cell(s.run)} | {_cell(s.failed)} | "
            f"{_cell(s.skipped)} | {seconds} | {s.box_s} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("steps", type=Path, help="the steps file gpu_check.sh wrote")
    p.add_argument("out", type=Path, help="folder for gpu_check.md and gpu_check.json")
    args = p.parse_args(argv)
    header, steps = read_steps(args.steps)
    steps = [judge(s) for s in steps]
    lines = markdown(header, steps)
    for s in steps:  # the benchmark's own table below the steps'
        if s.kind == "bench_json" and Path(s.artifacts[0]).with_suffix(".md").is_file():
            lines += ["", Path(s.artifacts[0]).with_suffix(".md").read_text().rstrip()]
    (args.out / "gpu_check.md").write_text("\n".join(lines) + "\n")
    report = {
        **header,
        "box_sum_s": sum(s.box_s for s in steps),
        "steps": [asdict(s) for s in steps],
    }
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=1) + "\n")
    print("\n".join(lines))
    no_gpu = all(s.status == NO_GPU for s in steps)
    return 0 if no_gpu or all(s.status == "ok" for s in steps) else 1


if __name__ == "__main__":
    sys.exit(main())

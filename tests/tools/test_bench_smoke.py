"""Every benchmark script in tools/bench runs to the end in its ``--tiny`` smoke mode.

One case per script (a file of tools/bench with a ``__main__`` block; the helper modules
``bench_data_common.py`` and ``bench_pipeline_all.py`` run through ``bench_data.py`` and
``bench_pipeline.py --all``), each run as ``python SCRIPT --tiny`` would run it, and it must exit 0:
the numbers a benchmark prints are not checked here (they are timings, for the reader), only that
the code that prints them still runs, with the checks a script makes itself (a non-zero exit). A
script without ``--tiny`` fails here (argparse exits 2). The timeout is a hang guard, far above
what the cases take on a loaded machine.

The selected cases run one after another in one subprocess (``tests/tools/run_scripts.py``: each
script under ``runpy`` as ``__main__``, in its own folder, its workers forked from a server that
has imported torch and megalite): torch, megalite and torch._dynamo are imported once instead of
once per script and once per worker, which was most of the smoke runs' cost (231 s of CPU in a
process each, 57 s so; 2 cores, load ~13). A module fixture runs them on first use; each case then
checks its own exit status and shows its output, its workers' included.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.paths import ROOT

BENCH = ROOT / "tools" / "bench"
LIBRARIES = {"bench_data_common.py", "bench_pipeline_all.py"}  # imported by the scripts
EXTRA = {  # flags beside --tiny: a private folder, the CPU path of a CUDA benchmark
    "bench_checkpoint.py": lambda tmp: ["--dir", str(tmp / "ckpt")],
    "bench_infinity.py": lambda tmp: ["--dir", str(tmp / "offload")],
    "bench_mfu.py": lambda tmp: ["--device", "cpu"],
}
SLOW = {  # more than ~20 s of CPU on 2 cores: run by the whole suite, skipped by -m "not slow"
    "bench_checkpoint.py",
    "bench_gpt_step.py",
    "bench_planner.py",
    "bench_tp_modes.py",
}


def scripts() -> list[str]:
    return sorted(
        p.name
        for p in BENCH.glob("*.py")
        if p.name not in LIBRARIES and 'if __name__ == "__main__":' in p.read_text()
    )


CASES = [(s, []) for s in scripts()] + [("bench_pipeline.py", ["--all"])]


def test_every_script_is_a_case_or_a_library():
    names = {p.name for p in BENCH.glob("*.py")}
    assert names == {s for s, _ in CASES} | LIBRARIES, names ^ ({s for s, _ in CASES} | LIBRARIES)


def case_id(script: str, flags: list[str]) -> str:
    return " ".join([script, *flags])


@pytest.fixture(scope="module")
def tiny_runs(request, tmp_path_factory):
    """{case id: (exit status, output)} of every selected case's ``--tiny`` run, one interpreter
    (the runner's fate instead of a status where it died or hung before the case ended)."""
    ids = {
        item.callspec.id
        for item in request.session.items
        if item.originalname == "test_tiny_run_exits_0"
    }
    out = tmp_path_factory.mktemp("bench")
    spec, names = [], {}
    for i, (script, flags) in enumerate(CASES):
        if case_id(script, flags) in ids:  # out/i: the case's working folder, its files
            (out / str(i)).mkdir()
            extra = EXTRA.get(script, lambda tmp: [])(out / str(i))
            spec.append([str(i), str(BENCH / script), ["--tiny", *flags, *extra]])
            names[case_id(script, flags)] = out / str(i)
    argv = [sys.executable, "-m", "tests.tools.run_scripts", str(out), json.dumps(spec)]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=2400)
        runner = f"the runner exited {proc.returncode}: {proc.stderr[-3000:]}"
    except subprocess.TimeoutExpired:
        runner = "the runner was stopped after 2400 s"
    workers = (out / "workers.txt").read_text() if (out / "workers.txt").exists() else ""
    parts = re.split(r"^=== run_scripts: (\S+) ===$", workers, flags=re.M)
    worker_output = dict(zip(parts[1::2], parts[2::2], strict=True))  # case folder: its workers'
    runs = {}
    for case, folder in names.items():
        output = (folder / "output.txt").read_text() if (folder / "output.txt").exists() else ""
        output += f"\n(its workers:)\n{worker_output.get(folder.name, '')}"
        done = (folder / "status").exists()
        runs[case] = (int((folder / "status").read_text()) if done else runner, output)
    return runs


@pytest.mark.parametrize(
    "script, flags",
    [
        pytest.param(s, f, id=case_id(s, f), marks=[pytest.mark.slow] if s in SLOW else [])
        for s, f in CASES
    ],
)
def test_tiny_run_exits_0(script, flags, tiny_runs):
    status, out = tiny_runs[case_id(script, flags)]
    assert status == 0, f"{case_id(script, flags)} --tiny: exit {status}\n{out[-6000:]}"

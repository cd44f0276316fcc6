"""Every benchmark script in tools/bench runs to the end in its ``--tiny`` smoke mode.

One case per script (a file of tools/bench with a ``__main__`` block; the helper modules
``bench_data_common.py`` and ``bench_pipeline_all.py`` run through ``bench_data.py`` and
``bench_pipeline.py --all``), each a subprocess that must exit 0: the numbers a benchmark prints
are not checked here (they are timings, for the reader), only that the code that prints them
still runs. A script without ``--tiny`` fails here (argparse exits 2). The timeout is a hang
guard, far above what a case takes on a loaded machine.
"""

from __future__ import annotations

import os
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


@pytest.mark.parametrize(
    "script, flags",
    [
        pytest.param(s, f, id=" ".join([s, *f]), marks=[pytest.mark.slow] if s in SLOW else [])
        for s, f in CASES
    ],
)
def test_tiny_run_exits_0(script, flags, tmp_path):
    argv = [sys.executable, str(BENCH / script), "--tiny", *flags]
    argv += EXTRA.get(script, lambda tmp: [])(tmp_path)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=900)
    out = f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, f"{' '.join(argv[1:])}: exit {proc.returncode}\n{out}"

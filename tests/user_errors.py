"""Shared pieces of the hardening tests: a tiny run's flags, small datasets, and the checks every
user error must pass (non-zero status, exactly one ``error:`` line naming the flag or file, no
traceback, fast)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from tests.data.helpers import write_dataset
from tests.paths import ROOT

# h=32, 2 layers, seq 8; NullTokenizer --vocab-size 127: ids 0..126, eod 127, 128 ids, padded 128.
TINY = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 8 "
    "--micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --train-iters 4 --log-interval 1000 "
    "--eval-iters 0 --tokenizer-type NullTokenizer --vocab-size 127 --device cpu --seed 3"
).split()


def good_docs(n: int = 40, *, high: int = 127, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, high, size=int(rng.integers(5, 20))) for _ in range(n)]


def dataset(folder: Path, name: str, docs: list | None = None) -> str:
    """A dataset prefix in ``folder`` (default: 40 documents of ids in the tiny vocabulary)."""
    return write_dataset(folder / name, good_docs() if docs is None else docs)


def one_error_line(err: str, *needles: str) -> str:
    """The single ``error:`` line of ``err`` (stderr): exactly one, no traceback, naming every
    needle."""
    assert "Traceback" not in err, err
    lines = [x for x in err.splitlines() if x.strip()]
    errors = [x for x in lines if x.startswith("error:")]
    assert len(errors) == 1, err
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])
    return errors[0]


def run_in_process(main, argv: list[str], capsys) -> tuple[int, str]:
    """``main(argv)`` (an entry point's guarded main): (status, stderr); stdout is dropped."""
    capsys.readouterr()
    started = time.perf_counter()
    status = main([str(a) for a in argv])
    # a hang guard, not a timing: a check that waited for a collective timeout (10 minutes by
    # default) instead of failing at once would miss it; a real check takes well under a second
    # of CPU, so half the timeout leaves room for any load on the machine
    assert time.perf_counter() - started < 300, "a start-up check took more than 300 s"
    return status, capsys.readouterr().err


def run_script(script: str, argv: list[str], **env) -> subprocess.CompletedProcess:
    """``python script argv`` from the repository root (stdout + stderr captured)."""
    full = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **env)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        full.pop(key, None)
    return subprocess.run(
        [sys.executable, str(ROOT / script), *map(str, argv)],
        capture_output=True,
        text=True,
        env=full,
        timeout=60,
        cwd=ROOT,
    )


def files_under(folder: Path) -> list[str]:
    """Every file below ``folder`` (relative paths, sorted); [] when it does not exist."""
    if not folder.exists():
        return []
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


@contextlib.contextmanager
def read_only(folder: Path):
    """``folder`` made unwritable even for root (the immutable attribute), restored after; yields
    False (and changes nothing) where ``chattr`` is not available."""
    folder.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        folder.chmod(0o555)
        try:
            yield True
        finally:
            folder.chmod(0o755)
        return
    ok = subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode == 0
    try:
        yield ok
    finally:
        if ok:
            subprocess.run(["chattr", "-i", str(folder)], check=True)

"""scripts/gpu_check.sh and tools/bench/bench_mfu.py on a machine without CUDA.

gpu_check.sh must say so in one line and exit 0; bench_mfu.py's whole code path runs in its
``--device cpu --tiny`` smoke mode (tiny models, a few steps) and prints its table and ratios.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.paths import ROOT as PATHS_ROOT

ROOT = str(PATHS_ROOT)
ENV = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is present")


@needs_no_cuda
def test_gpu_check_says_no_cuda_in_one_line_and_exits_0():
    out = subprocess.run(
        ["bash", os.path.join(ROOT, "scripts", "gpu_check.sh")],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check: no CUDA GPU"), out.stdout


@needs_no_cuda
def test_bench_mfu_without_cuda_says_so_and_exits_0():
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "bench", "bench_mfu.py")],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and out.stdout.strip().startswith("bench_mfu.py: no CUDA GPU")


def test_bench_mfu_tiny_cpu_smoke(tmp_path):
    table = tmp_path / "mfu.md"
    cmd = [sys.executable, os.path.join(ROOT, "tools", "bench", "bench_mfu.py"), "--device", "cpu"]
    cmd += ["--tiny", "--seq", "32", "--micro-batches", "2", "1", "--steps", "1"]
    cmd += ["--kinds", "megalite", "plain", "--out", str(table)]
    out = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    text = table.read_text()
    for model in ("gpt2-1.3b", "llama-1b"):
        for kind in ("megalite", "plain"):
            assert f"| {model} | {kind} | 2 |" in text, text
        assert f"{model}: megalite / plain tokens/s = " in text


def test_gpu_check_training_runs_are_valid_megalite_runs(monkeypatch):
    """Every training run gpu_check.sh would launch parses and validates as a world of one (the
    flags stay in step with the package without a GPU to run them on: CUDA is faked present)."""
    from megalite.training.arguments import parse_args

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    out = subprocess.run(
        ["bash", os.path.join(ROOT, "scripts", "gpu_check.sh")],
        env={**ENV, "GPU_CHECK_LIST_RUNS": "1"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    runs = dict(line.split(" ", 1) for line in out.stdout.strip().splitlines())
    assert {"train_llama_zero2", "train_llama_zero3", "train_llama_moe_ep1"} <= set(runs)
    for name, flags in runs.items():
        cfg = parse_args(flags.split(), env={})
        assert cfg.training.train_iters == 20, name
    stages = {
        name: parse_args(runs[name].split(), env={}).parallel.sharding_strategy()
        for name in ("train_llama_zero2", "train_llama_zero3")
    }
    assert stages == {"train_llama_zero2": "optim_grads", "train_llama_zero3": "optim_grads_params"}
    assert parse_args(runs["train_llama_moe_ep1"].split(), env={}).model.num_experts == 4

"""scripts/gpu_check.sh and tools/bench/bench_mfu.py on a machine without a GPU.

gpu_check.sh exits 2 without CUDA, and 0 with ``--allow-no-gpu``, every step reported "skipped (no
GPU)" (never ok). That run happens in an environment made like the GPU machine minus the GPU: no
network at all (a fresh network namespace, ``unshare -n``, where this runs as root; else proxies
that lead nowhere), ``PIP_NO_INDEX=1``, and whatever python runs the test (scripts/
test_torch_floor.sh runs this file under torch 2.11, the GPU machine's). The evidence that nothing
went to a network: every python the script starts carries an audit hook (a ``sitecustomize`` on
PYTHONPATH) that logs each socket connection, name lookup, ``python -m`` module and subprocess, and
``pip``, ``uv``, ``curl``, ``wget`` and ``git`` on PATH are stubs that log their call; both logs
must stay empty. bench_mfu.py's whole code path runs in its ``--device cpu --tiny`` smoke mode.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.paths import ROOT

GPU_CHECK = str(ROOT / "scripts" / "gpu_check.sh")
QUICK_STEPS = ["kernels_compiled", "cuda_paths", "training", "mfu"]

# logs every event that would reach a network, or start pip or another program, to $AUDIT_LOG
AUDIT_HOOK = """
import os, sys

def _audit(event, args):
    if event in ("socket.connect", "socket.getaddrinfo", "socket.sendto", "socket.bind",
                 "urllib.Request", "subprocess.Popen", "os.system", "cpython.run_module"):
        with open(os.environ["AUDIT_LOG"], "a") as f:
            f.write(f"{os.getpid()} {event} {args!r}\\n")

sys.addaudithook(_audit)
"""
STUB = '#!/bin/sh\necho "$(basename "$0") $*" >> "$STUB_LOG"\nexit 1\n'
STUBS = ("pip", "pip3", "uv", "curl", "wget", "git")


def _offline_env(tmp_path: Path) -> tuple[dict, list[str]]:
    """The environment and command prefix of a run with no network and logged attempts."""
    hook, bin_dir = tmp_path / "hook", tmp_path / "bin"
    hook.mkdir()
    bin_dir.mkdir()
    (hook / "sitecustomize.py").write_text(AUDIT_HOOK)
    for name in STUBS:
        (bin_dir / name).write_text(STUB)
        (bin_dir / name).chmod(0o755)
    dead = "http://127.0.0.1:9"  # the discard port: nothing answers
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "PYTHONPATH": str(hook),
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "AUDIT_LOG": str(tmp_path / "audit.log"),
        "STUB_LOG": str(tmp_path / "stubs.log"),
        "PIP_NO_INDEX": "1",
        "CUDA_VISIBLE_DEVICES": "",  # minus the GPU, also on a machine that has one
        **{k: dead for k in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY")},
    }
    no_net = ["unshare", "-n", "--"]
    probe = (
        subprocess.run([*no_net, "true"], capture_output=True) if shutil.which("unshare") else None
    )
    return env, (no_net if probe is not None and probe.returncode == 0 else [])


def _gpu_check(tmp_path: Path, *args: str):
    env, prefix = _offline_env(tmp_path)
    out = subprocess.run(
        [*prefix, "bash", GPU_CHECK, "quick", str(tmp_path / "out"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    logs = [tmp_path / "audit.log", tmp_path / "stubs.log"]
    touched = "".join(p.read_text() for p in logs if p.exists())
    return out, touched, prefix


def test_without_a_gpu_and_without_the_flag_it_exits_2_offline(tmp_path):
    out, touched, _ = _gpu_check(tmp_path)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "no CUDA GPU" in out.stderr and "nothing checked" in out.stderr
    assert touched == "", touched


def test_allow_no_gpu_reports_every_step_skipped_offline(tmp_path):
    out, touched, prefix = _gpu_check(tmp_path, "--allow-no-gpu")
    assert out.returncode == 0, (out.stdout, out.stderr)
    assert touched == "", f"reached for a network or a program (isolation {prefix}):\n{touched}"
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert [s["name"] for s in report["steps"]] == QUICK_STEPS
    assert {s["status"] for s in report["steps"]} == {"skipped (no GPU)"}
    assert report["device"] == "no CUDA GPU" and report["box_sum_s"] <= 360
    table = (tmp_path / "out" / "gpu_check.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) == 1 + len(QUICK_STEPS) and all("| skipped (no GPU) |" in r for r in rows[1:])
    assert "| ok |" not in table


def test_only_runs_the_steps_named(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""}
    cmd = [
        "bash",
        GPU_CHECK,
        "full",
        str(tmp_path),
        "--allow-no-gpu",
        "--only",
        "mfu_compile,cuda_paths",
    ]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [s["name"] for s in report["steps"]] == ["cuda_paths", "mfu_compile"]
    cmd[2:] = ["quick", str(tmp_path), "--only", "mfu_compile"]  # not a quick step
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "the quick steps are" in out.stderr


def test_unknown_mode_is_refused():
    out = subprocess.run(["bash", GPU_CHECK, "fast"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "quick or full" in out.stderr


def test_bench_mfu_without_cuda_says_so_and_exits_2():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    bench = str(ROOT / "tools" / "bench" / "bench_mfu.py")
    out = subprocess.run(
        [sys.executable, bench], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2 and out.stdout.startswith("bench_mfu.py: no CUDA GPU"), out


def test_bench_mfu_tiny_cpu_smoke(tmp_path):
    """The whole path on CPU: the planner's micro-batch (the largest of 1, 2 that fits), megalite
    through build_run + Trainer.step in bf16 with fp32 grads and masters, plain AMP, the table."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    bench = str(ROOT / "tools" / "bench" / "bench_mfu.py")
    md, js = tmp_path / "mfu.md", tmp_path / "mfu.json"
    kinds = ["megalite", "plain"]  # compile: the same path through torch.compile (slow on CPU)
    cmd = [sys.executable, bench, "--device", "cpu", "--tiny", "--kinds", *kinds]
    cmd += ["--out-md", str(md), "--out-json", str(js)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    report = json.loads(js.read_text())
    assert [(r["model"], r["impl"]) for r in report["rows"]] == [
        (m, k) for m in ("gpt2-1.3b", "llama-1b") for k in kinds
    ]
    for row in report["rows"]:
        assert row["status"] == "ok" and row["micro_batch"] == 2 and row["tokens_s"] > 0
    megalite = [r for r in report["rows"] if r["impl"] == "megalite"]
    for row in megalite:  # Megatron's mixed precision, read from the built run
        assert row["precision"] == {"params": "bfloat16", "grads": "float32", "master": "float32"}
        assert row["predicted_step_s"] > 0 and row["predicted_gib"] > 0
    text = md.read_text()
    for model in ("gpt2-1.3b", "llama-1b"):
        assert f"| {model} | megalite | bfloat16/float32/float32 | 2 |" in text, text
        assert f"{model}: megalite / plain tokens/s: " in text

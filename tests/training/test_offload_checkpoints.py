"""Checkpoints of a run whose state lives in files (ZeRO-3 with ``--param-offload-dir`` and
``--optimizer-offload-dir``): they hold the state itself, not the offload files.

- reshard: saved at DP 2 after 3 of 5 iterations with params and optimizer in files, resumed at
  DP 4 (params and optimizer in files again, fresh directories): iterations 4-5 equal the
  single-process oracle (1e-5: DP 2 and 4 differ in the order of sums only).
- crash: one process saving every 2 iterations is killed (SIGKILL) in the optimizer step of
  iteration 3, after its second chunk of state was written back to the files (they hold a
  half-updated state); the tracker still names iteration 2, and a new job resumes from it (fresh
  offload directories) to iteration 6 with the losses of a straight run (1e-5).
"""

from __future__ import annotations

import os
import subprocess
import sys

from megalite.checkpoint.files import read_tracker
from megalite.core.parallel_state import ParallelState
from megalite.training.pretrain import pretrain
from tests.harness import run_distributed
from tests.paths import ROOT
from tests.training.common import BASE, FAMILIES, assert_close_rel, config, train_losses
from tests.training.test_memory_ladder import save_or_resume_case


def in_files(tmp: str, name: str) -> tuple[str, ...]:
    """ZeRO-3 with params and optimizer state in files under ``tmp/name`` (small staging)."""
    return (
        *("--zero-stage", "3"),
        *("--param-offload-dir", f"{tmp}/{name}/param", "--param-offload-host-memory-mb", "0.01"),
        *("--optimizer-offload-dir", f"{tmp}/{name}/optim"),
        *("--optimizer-offload-host-memory-mb", "0.001"),
    )


def test_checkpoint_of_state_in_files_resumes_at_another_dp_size(tmp_path):
    oracle = train_losses(config(*FAMILIES["gpt2"]), ParallelState.single()).losses
    save = str(tmp_path / "ckpt")
    run_distributed(save_or_resume_case, 2, in_files(str(tmp_path), "dp2"), [(save, None)])
    assert os.path.isdir(f"{save}/iter_0000003")  # resumed from with --ckpt-step 3
    out = run_distributed(save_or_resume_case, 4, in_files(str(tmp_path), "dp4"), [(None, save)])
    resumed = [r[0] for r in out if r[0] is not None]
    assert resumed
    for losses in resumed:
        assert_close_rel(losses, oracle[3:], 1e-5, "resumed at DP 4")


def test_sigkill_in_an_offloaded_step_keeps_the_last_checkpoint(tmp_path):
    save = tmp_path / "ckpt"
    flags = ["--train-iters", "6", "--save", str(save), "--save-interval", "2"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), MEGALITE_TEST_DIE_IN_OFFLOAD_WRITE="3")
    script = ROOT / "tests" / "training" / "die_in_offload_write.py"
    cmd = [sys.executable, str(script), *BASE, *flags, *in_files(str(tmp_path), "killed")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == -9, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "MEGALITE_TEST_DIE_IN_OFFLOAD_WRITE: dies in iteration 3" in proc.stderr
    assert read_tracker(str(save)) == 2
    assert os.listdir(tmp_path / "killed" / "optim")  # the half-written state files

    resumed_flags = [*flags, *in_files(str(tmp_path), "resumed"), "--load", str(save)]
    resumed = pretrain(config(*resumed_flags), env={})
    straight = pretrain(config("--train-iters", "6"), env={})
    assert resumed.iteration == 6 and len(resumed.losses) == 4
    assert_close_rel(resumed.losses, straight.losses[2:], 1e-5, "resumed after SIGKILL")
    assert read_tracker(str(save)) == 6

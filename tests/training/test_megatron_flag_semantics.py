"""Megatron flags that change what a run does, doing it:

- ``--use-checkpoint-opt_param-scheduler``: the LR schedule's settings come from the checkpoint,
  not the flags. A run saves at iteration 2 of 4 under schedule A; resumed with flags of another
  schedule B and the flag, its losses are bitwise the straight run's last 2 (schedule A, exactly),
  in megalite's format and in Megatron's ``torch`` format (which counts in samples); without the
  flag they differ (schedule B). Beside ``--override-opt_param-scheduler``: refused in one line.
- ``--deterministic-mode``: torch's deterministic algorithms and the environment of bit-exact GPU
  runs inside the run, restored after; a launcher's non-deterministic value refused in one line;
  on CPU the losses are the plain run's.
- ``--moe-router-dtype fp32`` is megalite's router (accepted), fp64 refused in one line;
  ``--account-for-embedding/loss-in-pipeline-split`` become the first / last stage's layer counts.
"""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager

import pytest
import torch

from megalite.errors import ConfigError
from megalite.training.determinism import ENV_DEFAULTS, deterministic_mode
from megalite.training.pretrain import pretrain
from megalite.training.trainer import FirstStepHook
from tests.training.common import config

SCHEDULE_A = "--lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 1".split()
SCHEDULE_B = "--lr 3e-3 --min-lr 0 --lr-decay-style linear --lr-warmup-iters 0".split()
RUN = ["--train-iters", "4"]


@pytest.mark.parametrize("ckpt_format", ["megalite", "torch"])
def test_use_checkpoint_opt_param_scheduler_takes_the_checkpoints_schedule(ckpt_format):
    with tempfile.TemporaryDirectory() as save:
        saving = ["--save", save, "--save-interval", "2", "--ckpt-format", ckpt_format]
        straight = pretrain(config(*RUN, *SCHEDULE_A, *saving))
        resume = ["--load", save, "--ckpt-step", "2", "--ckpt-format", ckpt_format]
        flag = "--use-checkpoint-opt_param-scheduler"
        taken = pretrain(config(*RUN, *SCHEDULE_B, *resume, flag))
        flags_own = pretrain(config(*RUN, *SCHEDULE_B, *resume))
    assert len(straight.losses) == 4 and len(taken.losses) == 2
    assert taken.losses == straight.losses[2:], (taken.losses, straight.losses)
    assert flags_own.losses != straight.losses[2:], "schedule B trains the same: vacuous"


def test_override_and_use_checkpoint_opt_param_scheduler_contradict():
    with pytest.raises(ConfigError) as e:
        config(*RUN, "--override-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler")
    assert "contradict" in str(e.value) and "\n" not in str(e.value)


def test_deterministic_mode_sets_and_restores_torch_and_the_environment():
    env = {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}  # a launcher's deterministic value is kept
    before = torch.are_deterministic_algorithms_enabled()
    with deterministic_mode(True, env):
        assert torch.are_deterministic_algorithms_enabled()
        assert env == {**ENV_DEFAULTS, "CUBLAS_WORKSPACE_CONFIG": ":16:8"}
        assert env["NCCL_ALGO"] == "Ring"
    assert torch.are_deterministic_algorithms_enabled() == before
    assert env == {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}
    for bad in ({"NCCL_ALGO": "Tree"}, {"CUBLAS_WORKSPACE_CONFIG": ":0:0"}):
        with pytest.raises(ConfigError) as e:
            with deterministic_mode(True, dict(bad)):
                pass
        assert "--deterministic-mode" in str(e.value) and "\n" not in str(e.value)
    with deterministic_mode(False, env):
        assert torch.are_deterministic_algorithms_enabled() == before


class _Watch(FirstStepHook):
    """What the run's first step sees: torch's deterministic flag and NCCL_ALGO."""

    def __init__(self) -> None:
        self.seen: list[tuple[bool, str | None]] = []

    def around_first_step(self, trainer):
        @contextmanager
        def watch():
            self.seen.append(
                (torch.are_deterministic_algorithms_enabled(), os.environ.get("NCCL_ALGO"))
            )
            yield

        return watch()


def test_deterministic_mode_is_on_during_the_run_and_changes_no_cpu_number(monkeypatch):
    monkeypatch.delenv("NCCL_ALGO", raising=False)
    watch = _Watch()
    deterministic = pretrain(config(*RUN, "--deterministic-mode"), first_step_hooks=[watch])
    plain = pretrain(config(*RUN))
    assert watch.seen == [(True, "Ring")]
    assert deterministic.losses == plain.losses
    assert not torch.are_deterministic_algorithms_enabled()


def test_router_dtype_and_pipeline_split_accounting():
    config(*RUN, "--num-experts", "4", "--moe-router-dtype", "fp32")
    with pytest.raises(ConfigError) as e:
        config(*RUN, "--num-experts", "4", "--moe-router-dtype", "fp64")
    assert "fp64 is not implemented" in str(e.value) and "\n" not in str(e.value)
    pp2 = ["--num-layers", "3", "--pipeline-model-parallel-size", "2"]
    cfg = config(*RUN, *pp2, "--account-for-embedding-in-pipeline-split", world_size=2)
    assert cfg.model.stage_layer_ranges(2) == [(0, 1), (1, 3)]  # (3 + 1) / 2: the first holds 1
    both = ["--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"]
    pp2_even = ["--num-layers", "4", "--pipeline-model-parallel-size", "2"]
    cfg = config(*RUN, *pp2_even, *both, world_size=2)
    assert cfg.model.stage_layer_ranges(2) == [(0, 2), (2, 4)]  # (4 + 2) / 2 - 1 each
    with pytest.raises(ConfigError) as e:
        config(*RUN, *pp2_even, "--account-for-loss-in-pipeline-split", world_size=2)
    assert "4 + 1 = 5 is not divisible" in str(e.value)

"""pretrain_gpt.py logs the planner's prediction for its own layout and, after the first step, the
measured figures beside it, and writes both to TensorBoard (read back with tensorboard's reader):
the first-step hook ``measure.first_step.FirstStepComparison`` it hands to ``pretrain``."""

from __future__ import annotations

import importlib.util
import logging
import os
import re

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megalite.measure import first_step
from megalite.measure.first_step import FirstStepComparison, uncovered_features
from megalite.training.pretrain import pretrain
from tests.paths import ROOT
from tests.training.common import BASE, config


@pytest.fixture
def restore_logging():
    root = logging.getLogger("megalite")
    saved = (list(root.handlers), root.level, root.propagate)
    yield
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])
    root.propagate = saved[2]


def _entry():
    spec = importlib.util.spec_from_file_location("pretrain_gpt", ROOT / "pretrain_gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _one_process(monkeypatch) -> None:
    """No launcher in the environment: pretrain_gpt.py runs as one plain process."""
    for name in list(os.environ):
        if name in ("RANK", "WORLD_SIZE", "LOCAL_RANK") or name.startswith("SLURM_"):
            monkeypatch.delenv(name)


def test_pretrain_gpt_prints_and_logs_prediction_beside_measurement(
    tmp_path, capsys, restore_logging, monkeypatch
):
    tb = tmp_path / "tb"
    _one_process(monkeypatch)
    flags = ["--train-iters", "2", "--tensorboard-dir", str(tb), "--recompute-activations"]
    flags += ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
    assert _entry().main([*BASE, *flags]) == 0
    out = capsys.readouterr().out
    assert "planner: predicted per rank (pp rank 0): model state" in out
    line = next(x for x in out.splitlines() if "planner vs first step" in x)
    numbers = [float(v) for v in re.findall(r"(?:predicted|measured) ([\d.]+) MiB", line)]
    state_p, state_m, act_p, act_m = numbers
    assert state_p == state_m
    assert abs(act_p - act_m) <= 0.05 * act_m

    events = EventAccumulator(str(tb))
    events.Reload()
    scalars = {t: events.Scalars(t) for t in events.Tags()["scalars"] if t.startswith("planner/")}
    assert set(scalars) == {
        "planner/predicted-state-mib",
        "planner/measured-state-mib",
        "planner/predicted-activations-mib",
        "planner/measured-activations-mib",
        "planner/predicted-peak-mib",
    }
    assert [e.step for e in scalars["planner/measured-activations-mib"]] == [1]
    assert scalars["planner/measured-state-mib"][0].value == pytest.approx(state_m, abs=0.01)


def test_a_layout_the_planner_cannot_predict_still_trains(capsys, restore_logging, monkeypatch):
    def unknown(trainer):
        raise KeyError("interleaved")  # e.g. a schedule added before the planner knows it

    monkeypatch.setattr(first_step, "predicted_for_rank", unknown)
    hooks = [FirstStepComparison()]
    result = pretrain(config("--train-iters", "1"), env={}, first_step_hooks=hooks)
    assert result.iteration == 1
    assert "planner: no prediction for this layout (KeyError" in capsys.readouterr().out


def test_features_the_planner_does_not_model_are_named_not_predicted():
    cfg = config()
    assert uncovered_features(cfg) == []
    cfg.parallel.zero_stage = 3  # the whole ladder, CP p2p and MoE are modelled
    cfg.parallel.context_parallel_size = 2
    cfg.model.num_experts = 4
    assert uncovered_features(cfg) == []
    cfg.parallel.optimizer_offload_dir = "/tmp/nvme"
    cfg.model.cp_comm_type = "a2a"
    assert uncovered_features(cfg) == [
        "--optimizer-offload-dir (NVMe offload)",
        "--cp-comm-type a2a",
    ]

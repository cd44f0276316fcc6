"""``pretrain`` in one plain process: the log lines, evaluation, and TensorBoard event files read
back with tensorboard's own reader, holding exactly the values the run produced."""

from __future__ import annotations

import logging

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megalite.training.pretrain import pretrain
from tests.training.common import config


@pytest.fixture
def restore_logging():
    root = logging.getLogger("megalite")
    saved = (list(root.handlers), root.level, root.propagate)
    yield
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])
    root.propagate = saved[2]


def test_single_process_run_writes_log_lines_and_tensorboard_scalars(
    tmp_path, capsys, restore_logging
):
    tb = tmp_path / "tb"
    run = "--train-iters 4 --log-interval 2 --eval-interval 2 --eval-iters 1 --bf16".split()
    cfg = config(*run, "--tensorboard-dir", str(tb))
    result = pretrain(cfg, env={})
    out = capsys.readouterr().out
    lines = [x for x in out.splitlines() if x.startswith(" iteration ")]
    assert [x.split("|")[0].split()[1] for x in lines] == ["2/", "4/"]
    assert "lm loss: " in lines[0] and "MFU: n/a" in lines[0] and "tokens/s: " in lines[0]
    assert out.count(" validation loss at iteration 2 | lm loss value: ") == 1
    assert " validation loss at iteration 4 on test set | " in out

    events = EventAccumulator(str(tb))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {
        "lm loss",
        "learning-rate",
        "loss-scale",
        "grad-norm",
        "batch-size",
        "num-skipped-iterations",
        "iteration-time",
        "tokens-per-second",
        "tflops-per-device",
        "peak-memory-mib",
        "lm loss validation",
        "lm loss validation ppl",
        "lm loss test",
    } <= tags
    loss = events.Scalars("lm loss")
    assert [e.step for e in loss] == [1, 2, 3, 4]
    assert [e.value for e in loss] == pytest.approx(result.losses, rel=1e-6)
    assert [e.step for e in events.Scalars("iteration-time")] == [2, 4]
    assert [e.step for e in events.Scalars("lm loss validation")] == [2, 4, 4]
    assert events.Scalars("batch-size")[0].value == 8
    assert events.Scalars("lm loss validation")[-1].value == pytest.approx(
        result.validation["lm loss"], rel=1e-6
    )
    assert events.Scalars("lm loss test")[-1].value == pytest.approx(
        result.test["lm loss"], rel=1e-6
    )


def test_compressed_optimizer_scalars(tmp_path, restore_logging):
    """1-bit Adam frozen after step 2 (one process: the compressed all-reduce over a group of one
    sends nothing, its error buffers still fill): the phase steps from 0 to 1 after the freeze,
    the error norm becomes positive, and the bytes sent are 0 on a group of one."""
    tb = tmp_path / "tb"
    run = "--train-iters 4 --optimizer onebit-adam --onebit-freeze-step 2".split()
    pretrain(config(*run, "--tensorboard-dir", str(tb)), env={})
    events = EventAccumulator(str(tb))
    events.Reload()
    assert [e.value for e in events.Scalars("compression-phase")] == [0, 0, 1, 1]
    errors = [e.value for e in events.Scalars("compression-error-norm")]
    assert errors[:2] == [0, 0] and min(errors[2:]) > 0
    assert [e.value for e in events.Scalars("compressed-bytes-sent")] == [0, 0, 0, 0]

"""The Megatron-shaped progress lines, character for character, and the rank filter."""

from __future__ import annotations

import logging

from megalite.training.logging import (
    IntervalStats,
    configure_logging,
    format_iteration_line,
    format_validation_line,
)


def _stats(**kw) -> IntervalStats:
    base = dict(
        iteration=10,
        train_iters=500,
        consumed_samples=320,
        ms_per_iteration=123.456,
        learning_rate=3e-4,
        global_batch_size=32,
        losses={"lm loss": 4.0123456789},
        loss_scale=65536.0,
        grad_norm=1.23456,
        skipped_iterations=1,
        nan_iterations=0,
        tokens_per_second=4321.7,
        tflops_per_device=12.3456,
        mfu_percent=4.56789,
        peak_memory_mib=1024.25,
    )
    base.update(kw)
    return IntervalStats(**base)


def test_iteration_line_exact():
    assert format_iteration_line(_stats()) == (
        " iteration       10/     500 | consumed samples:          320 | "
        "elapsed time per iteration (ms): 123.5 | learning rate: 3.000000E-04 | "
        "global batch size:    32 | lm loss: 4.012346E+00 | loss scale: 65536.0 | "
        "grad norm: 1.235 | number of skipped iterations:   1 | number of nan iterations:   0 | "
        "tokens/s: 4322 | TFLOP/s per device: 12.346 | MFU: 4.57% | "
        "peak memory per rank (MiB): 1024.2 |"
    )
    line = format_iteration_line(_stats(grad_norm=None, mfu_percent=None))
    assert "grad norm" not in line and "MFU: n/a" in line


def test_validation_line_exact():
    text = format_validation_line("iteration 100", {"lm loss": 2.0})
    rule, body, rule2 = text.split("\n")
    assert body == (
        " validation loss at iteration 100 | lm loss value: 2.000000E+00 | "
        "lm loss PPL: 7.389056E+00 |"
    )
    assert rule == rule2 == "-" * len(body)
    assert "PPL: 4.851652E+08" in format_validation_line("iteration 1", {"lm loss": 50.0})


def test_info_on_the_log_rank_only_warnings_everywhere(capsys):
    log, root = logging.getLogger("megalite.training.test"), logging.getLogger("megalite")
    saved = (list(root.handlers), root.level, root.propagate)
    try:
        for rank in (0, 3):
            configure_logging(rank=rank, log_rank=3)
            log.info("progress")
            log.warning("careful")
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
        root.propagate = saved[2]
    out = capsys.readouterr().out.splitlines()
    assert out == ["[rank 0] warning: careful", "progress", "[rank 3] warning: careful"]

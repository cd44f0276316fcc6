"""LR schedule values against the formulas written out by hand, and a state round trip."""

from __future__ import annotations

import math

import pytest
import torch

from megalite.training.config import OptimizerConfig
from megalite.training.lr_scheduler import LRScheduler


class _Opt:
    def __init__(self):
        self.param_groups = [{"lr": None}, {"lr": None}]


def _lrs(style: str, n: int = 12, **kw) -> list[float]:
    opt = _Opt()
    s = LRScheduler(
        opt, max_lr=1.0, min_lr=0.1, warmup_iters=2, decay_iters=10, decay_style=style, **kw
    )
    out = []
    for _ in range(n):
        assert opt.param_groups[0]["lr"] == opt.param_groups[1]["lr"] == s.get_lr()
        out.append(s.get_lr())
        s.step()
    return out


def test_warmup_then_each_decay_style():
    warm = [0.0, 0.5, 1.0]  # n = 0, 1, 2: linear from --lr-warmup-init 0 over 2 steps
    ratios = [(n - 2) / 8 for n in range(3, 11)]  # n = 3..10
    linear = _lrs("linear")
    assert linear[:3] == warm
    assert linear[3:11] == pytest.approx([0.1 + 0.9 * (1 - r) for r in ratios])
    assert linear[11] == 0.1  # past --lr-decay-iters: --min-lr
    cosine = _lrs("cosine")
    assert cosine[3:11] == pytest.approx(
        [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * r)) for r in ratios]
    )
    assert cosine[10] == pytest.approx(0.1) and cosine[11] == 0.1
    assert _lrs("constant")[3:] == [1.0] * 9
    inv = _lrs("inverse-square-root")  # Megatron: past --lr-decay-iters (n = 11) it is --min-lr
    assert inv[3:11] == pytest.approx([max(0.1, math.sqrt(2 / n)) for n in range(3, 11)])
    assert inv[11] == 0.1
    assert _lrs("linear", warmup_init=0.2)[:3] == pytest.approx([0.2, 0.6, 1.0])


def test_state_round_trip_and_warmup_fraction():
    a, b = _Opt(), _Opt()
    s = LRScheduler(
        a, max_lr=3e-4, min_lr=3e-5, warmup_iters=5, decay_iters=50, decay_style="cosine"
    )
    for _ in range(17):
        s.step()
    t = LRScheduler(b, max_lr=1.0, min_lr=0.0, warmup_iters=0, decay_iters=1, decay_style="linear")
    t.load_state_dict(s.state_dict())
    assert b.param_groups[0]["lr"] == a.param_groups[0]["lr"]
    s.step(), t.step()
    assert t.get_lr() == s.get_lr() and t.num_steps == 18
    assert OptimizerConfig(lr_warmup_fraction=0.1).warmup_iters(250) == 25


def test_bad_schedule_is_refused():
    with pytest.raises(ValueError, match="--lr-warmup-iters 20 exceeds --lr-decay-iters 10"):
        LRScheduler(
            _Opt(), max_lr=1, min_lr=0, warmup_iters=20, decay_iters=10, decay_style="linear"
        )


def _logged_lrs(flags: str, iters: int) -> list[float]:
    """The learning rate each of ``iters`` iterations uses, with the scheduler that
    ``pretrain_gpt.py`` builds from ``flags`` (tiny model, global batch 8)."""
    from megalite.core.parallel_state import ParallelState
    from megalite.training.components import setup_model_and_optimizer
    from tests.training.common import config

    cfg = config(*flags.split(), "--train-iters", str(iters))
    _, optimizer, scheduler = setup_model_and_optimizer(
        cfg, ParallelState.single(), device=torch.device("cpu")
    )
    out = []
    for _ in range(iters):
        out.append(optimizer.param_groups[0]["lr"])
        scheduler.step()
    return out


def test_inverse_square_root_is_min_lr_past_decay_iters():
    # Megatron's OptimizerParamScheduler counts samples: B = 8 per iteration, W = 2B, D = 5B;
    # iteration k uses n = (k - 1) B samples.
    #   n <= W: lr = 1e-3 * n / W            -> k = 1, 2, 3: 0, 5e-4, 1e-3
    #   W < n <= D: 1e-3 * sqrt(W / n)        -> k = 4, 5, 6: 1e-3 sqrt(2/3), sqrt(2/4), sqrt(2/5)
    #   n > D: --min-lr                        -> k = 7, 8: 1e-5 (5.77e-4, 5.35e-4 before)
    lrs = _logged_lrs(
        "--lr 1e-3 --min-lr 1e-5 --lr-warmup-iters 2 --lr-decay-iters 5 "
        "--lr-decay-style inverse-square-root",
        8,
    )
    expected = [
        0.0,
        5e-4,
        1e-3,
        8.16496580927726e-4,
        7.0710678118654752e-4,
        6.324555320336759e-4,
        1e-5,
        1e-5,
    ]
    assert lrs == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_warmup_fraction_counts_samples():
    # --lr-warmup-fraction 0.25 of D = 10 iterations: W = 0.25 x 10 B = 2.5 B samples (not rounded
    # to 2 iterations). k = 1, 2, 3: 1e-3 x 0, 1/2.5, 2/2.5 = 0, 4e-4, 8e-4; k = 4 (n = 3 B):
    # r = (3 - 2.5) / (10 - 2.5) = 1/15, lr = 1e-5 + (1e-3 - 1e-5)(1 - 1/15) = 9.34e-4;
    # k = 10 (n = 9 B): r = 6.5/7.5, lr = 1e-5 + 9.9e-4 x 1/7.5 = 1.42e-4.
    lrs = _logged_lrs(
        "--lr 1e-3 --min-lr 1e-5 --lr-warmup-fraction 0.25 --lr-decay-style linear", 10
    )
    assert lrs[:4] == pytest.approx([0.0, 4e-4, 8e-4, 1e-5 + 9.9e-4 * 14 / 15], rel=1e-12)
    assert lrs[3] == pytest.approx(9.34e-4, abs=5e-7)
    assert lrs[9] == pytest.approx(1e-5 + 9.9e-4 / 7.5, rel=1e-12)


def test_inverse_square_root_clamps_count_samples():
    # No warmup: Megatron's lr = max_lr sqrt(max(W, 1) / max(n, 1)) on sample counts, so with
    # W = 0 and B = 8 samples a step, step n = 1 gives 1e-3 sqrt(1 / 8), n = 2 gives sqrt(1 / 16).
    opt = _Opt()
    s = LRScheduler(
        opt,
        max_lr=1e-3,
        min_lr=0.0,
        warmup_iters=0,
        decay_iters=10,
        decay_style="inverse-square-root",
        samples_per_step=8,
    )
    lrs = [s.get_lr()]
    for _ in range(2):
        s.step()
        lrs.append(s.get_lr())
    assert lrs == pytest.approx([1e-3, 1e-3 * math.sqrt(1 / 8), 2.5e-4], rel=1e-12)
    # the same schedule counted in samples (a batch-size ramp) gives the same numbers
    t = LRScheduler(
        _Opt(),
        max_lr=1e-3,
        min_lr=0.0,
        warmup_iters=0,
        decay_iters=80,
        decay_style="inverse-square-root",
    )
    t.step(8)
    assert t.get_lr() == pytest.approx(lrs[1], rel=1e-12)

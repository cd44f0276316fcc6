"""LR schedule values against the formulas written out by hand, and a state round trip."""

from __future__ import annotations

import math

import pytest

from megalite.training.config import OptimizerConfig
from megalite.training.lr_schedule import LRScheduler


class _Opt:
    def __init__(self):
        self.param_groups = [{"lr": None}, {"lr": None}]


def _lrs(style: str, n: int = 12, **kw) -> list[float]:
    opt = _Opt()
    s = LRScheduler(opt, max_lr=1.0, min_lr=0.1, warmup_iters=2, decay_iters=10,
                    decay_style=style, **kw)  # fmt: skip
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
    inv = _lrs("inverse-square-root")
    assert inv[3:] == pytest.approx([max(0.1, math.sqrt(2 / n)) for n in range(3, 12)])
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

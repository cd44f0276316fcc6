"""``bench_onebit.loss_gaps``: the per-step and the logged (Megatron's interval mean) loss gaps
after the warm-up, on hand-made curves whose gaps are known."""

from __future__ import annotations

import sys

import pytest

from tests.paths import ROOT

sys.path.insert(0, str(ROOT / "tools" / "bench"))

from bench_onebit import loss_gaps  # noqa: E402


def test_per_step_and_logged_gaps():
    base = [10.0] * 8
    # warm-up steps 1-2 (freeze 2) may differ without counting; step 4 is 5% below
    curve = [20.0, 20.0, 10.1, 9.5, 10.0, 10.0, 10.3, 10.0]
    g = loss_gaps(curve, base, freeze=2)
    assert (g.worst_step, g.count, g.over) == (4, 6, 2)
    assert g.worst == pytest.approx(-0.05) and g.last == pytest.approx(0.0)
    # logged every 2 steps: means of steps 3-4, 5-6, 7-8 (the window 1-2 is the warm-up's)
    g = loss_gaps(curve, base, freeze=2, interval=2)
    assert (g.worst_step, g.count, g.over) == (4, 3, 0)
    assert g.worst == pytest.approx(-0.02) and g.last == pytest.approx(0.015)
    # a window that starts inside the warm-up is not logged after it
    g = loss_gaps(curve, base, freeze=3, interval=2)
    assert (g.worst_step, g.count) == (8, 2)  # steps 5-6 and 7-8


def test_no_logged_step_after_the_warm_up():
    with pytest.raises(ValueError, match="freeze 7, interval 2"):
        loss_gaps([1.0] * 8, [1.0] * 8, freeze=7, interval=2)

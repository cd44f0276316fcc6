"""The count-sketch estimate of the DP-averaged grad's norm (``sketched_norm``), in one process.

- ``_fold`` puts value ``i`` in bucket ``(start + i) mod size``: against ``index_add_``.
- At most ``size`` values: each has its own bucket and the estimate equals the squared norm.
- Past ``size`` values, on grads whose coordinates are all positive (the case random signs are for:
  without them each bucket's sum grows with its count of values, an estimate ~18x too large here):
  the standard deviation of one estimate is about sqrt(2 / 256) = 8.8%; each of 64 seeds' is within
  40% of the squared norm, their mean within 3.5% (3 standard deviations of a mean of 64: no
  bias), and equal seeds give equal estimates (every DP rank draws the same signs).
"""

from __future__ import annotations

import torch

from megalite.core.optimizer.sketched_norm import _fold, sketch_size, sketched_mean_sq_norm


def test_fold_wraps_like_modulo() -> None:
    values = torch.randn(2503, generator=torch.Generator().manual_seed(0))
    for start in (0, 5, 13):
        got = torch.zeros(13)
        _fold(got, values, start)
        want = torch.zeros(13).index_add_(0, (start + torch.arange(2503)) % 13, values)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _grads(shapes: list[tuple[int, ...]], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.rand(s, generator=gen) + 0.5 for s in shapes]


def _estimate(grads: list[torch.Tensor], *, seed: int, size: int) -> tuple[float, float]:
    mean_sq, own_sq = sketched_mean_sq_norm(
        grads, dp_group=None, seed=seed, device=torch.device("cpu"), size=size
    )
    return float(mean_sq), float(own_sq)


def test_exact_when_each_value_has_a_bucket() -> None:
    grads = _grads([(10, 20), (37,), (3, 3, 3)], seed=1)  # 264 values
    assert sketch_size(264, 1024) == 264
    exact = float(sum(g.double().square().sum() for g in grads))
    mean_sq, own_sq = _estimate(grads, seed=7, size=1024)
    assert abs(mean_sq - exact) <= 1e-6 * exact
    assert abs(own_sq - exact) <= 1e-6 * exact


def test_unbiased_past_the_buckets() -> None:
    grads = _grads([(40, 100), (1000,), (77,)], seed=2)  # 5,077 values in 256 buckets
    exact = float(sum(g.double().square().sum() for g in grads))
    estimates = [_estimate(grads, seed=s, size=256) for s in range(64)]
    for mean_sq, own_sq in estimates:
        assert abs(mean_sq / exact - 1) < 0.4, mean_sq / exact
        assert abs(own_sq / exact - 1) < 1e-6
    average = sum(e for e, _ in estimates) / len(estimates)
    assert abs(average / exact - 1) < 0.035, average / exact
    assert _estimate(grads, seed=3, size=256) == estimates[3]

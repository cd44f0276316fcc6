"""LAMB equals a hand-written LAMB; 1-bit LAMB's warm-up equals LAMB bitwise, and its compressed
phase equals a hand-written 1-bit LAMB (momentum through the compressed all-reduce's definition,
variance frozen, the frozen trust ratio rescaled by the factor from a fresh variance of the
reconstructed gradient, within its bounds and its per-step threshold).

One process, a two-linear model, 5 steps of lr 0.05 on fixed batches, through ``build_optimizer``
(masters, megalite's groups: matrices decayed, biases not). The hand-written LAMB below follows
the paper's formula element by element with Python floats for the bias corrections; 1e-6
relative (fp32, the same operations in another order). The trust ratio bounds are set so that
both the upper bound and the ratio itself act (``max_trust_ratio`` below the largest ratio).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from megalite.core.distributed.compressed_allreduce import chunk_numel, reference_allreduce
from megalite.core.optimizer import build_optimizer
from megalite.core.optimizer.compressed import CompressionSpec

LR, WD, B1, B2, EPS, STEPS = 0.05, 0.1, 0.9, 0.999, 1e-6, 5
MIN_TRUST, MAX_TRUST = 0.01, 0.5


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def _grads(model: nn.Module, step: int) -> None:
    gen = torch.Generator().manual_seed(step)
    x, y = torch.randn(6, 5, generator=gen), torch.randn(6, 3, generator=gen)
    model.zero_grad()
    (model(x) - y).square().mean().backward()


def _hand_lamb(model: nn.Module) -> list[float]:
    """Returns each step's trust ratios (to see that the bounds act)."""
    state = {p: (torch.zeros_like(p), torch.zeros_like(p)) for p in model.parameters()}
    seen = []
    for step in range(1, STEPS + 1):
        _grads(model, step)
        with torch.no_grad():
            for p in model.parameters():
                m, v = state[p]
                m.copy_(B1 * m + (1 - B1) * p.grad)
                v.copy_(B2 * v + (1 - B2) * p.grad * p.grad)
                r = (m / (1 - B1**step)) / ((v / (1 - B2**step)).sqrt() + EPS)
                r = r + (WD if p.ndim > 1 else 0.0) * p
                ratio = (p.norm() / r.norm()).item()
                seen.append(ratio)
                p.sub_(LR * min(max(ratio, MIN_TRUST), MAX_TRUST) * r)
    return seen


def _hand_onebit_lamb(
    model: nn.Module, freeze: int, factor: tuple[float, float, float] = (0.5, 4.0, 0.1)
) -> list[float]:
    """LAMB for ``freeze`` steps keeping ``coeff = 0.9 coeff + 0.1 trust``; then the momentum of
    the local grad through the compressed all-reduce (one process: sign and scale with error
    feedback), the variance frozen with its bias correction, the trust ratio the frozen coeff
    times the factor: ``g = (m_t - b1 m_{t-1}) / (1 - b1)``, ``fresh = b2 fresh + (1 - b2) g^2``
    (from ``v`` at the freeze), ``c = max(frozen denominator / fresh one)`` over the tensor,
    clamped to ``[low, high]`` and to ``last * (1 -+ threshold)``. Returns every unclamped ``c``
    (to see that the bounds act)."""
    low, high, threshold = factor
    params = sorted(model.parameters(), key=lambda p: p.ndim == 1)  # the optimizer's groups
    state = {p: (torch.zeros_like(p), torch.zeros_like(p)) for p in params}
    coeff: dict = {}
    fresh = {p: None for p in params}
    last = {p: 1.0 for p in params}
    peaks = []
    numel = sum(p.numel() for p in params)
    worker, server = [torch.zeros(numel)], [torch.zeros(chunk_numel(numel, 1))]
    for step in range(1, STEPS + 1):
        _grads(model, step)
        with torch.no_grad():
            before = {p: state[p][0].clone() for p in params}
            for p in params:
                m, _ = state[p]
                m.copy_(B1 * m + (1 - B1) * p.grad)
            if step > freeze:
                mean = reference_allreduce([torch.cat([state[p][0].reshape(-1) for p in params])],
                                           worker, server)  # fmt: skip
                offset = 0
                for p in params:
                    state[p][0].copy_(mean[offset : offset + p.numel()].view_as(p))
                    offset += p.numel()
            for p in params:
                m, v = state[p]
                if step <= freeze:
                    v.copy_(B2 * v + (1 - B2) * p.grad * p.grad)
                k = min(step, freeze)
                r = (m / (1 - B1**step)) / ((v / (1 - B2**k)).sqrt() + EPS)
                r = r + (WD if p.ndim > 1 else 0.0) * p
                if step <= freeze:
                    trust = min(max((p.norm() / r.norm()).item(), MIN_TRUST), MAX_TRUST)
                    coeff[p] = 0.9 * coeff.get(p, trust) + 0.1 * trust
                    p.sub_(LR * trust * r)
                else:
                    g = (m - B1 * before[p]) / (1 - B1)
                    f = v.clone() if fresh[p] is None else fresh[p]
                    fresh[p] = B2 * f + (1 - B2) * g * g
                    frozen = (v / (1 - B2**freeze)).sqrt() + EPS
                    peak = (frozen / ((fresh[p] / (1 - B2**step)).sqrt() + EPS)).max().item()
                    peaks.append(peak)
                    c = min(max(peak, low), high)
                    c = min(max(c, last[p] * (1 - threshold)), last[p] * (1 + threshold))
                    last[p] = c
                    p.sub_(LR * min(max(coeff[p], MIN_TRUST), MAX_TRUST) * c * r)
    return peaks


def _megalite(
    optimizer: str, freeze: int = STEPS, factor: tuple[float, float, float] = (0.5, 4.0, 0.1)
) -> nn.Module:
    model = _model()
    low, high, threshold = factor
    opt = build_optimizer(
        model,
        optimizer=optimizer,
        lr=LR,
        weight_decay=WD,
        adam_eps=EPS,
        clip_grad=0.0,
        lamb_trust_ratio=(MIN_TRUST, MAX_TRUST),
        compression=CompressionSpec(
            freeze_step=freeze, factor_min=low, factor_max=high, factor_threshold=threshold
        ),
    )
    for step in range(1, STEPS + 1):
        _grads(model, step)
        opt.step()
    return model


def test_lamb_equals_hand_written() -> None:
    want = _model()
    ratios = _hand_lamb(want)
    assert max(ratios) > MAX_TRUST > min(ratios)  # the bound and the ratio both act
    got = _megalite("lamb")
    for a, b in zip(got.parameters(), want.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_onebit_lamb_warmup_is_lamb_bitwise() -> None:
    for a, b in zip(_megalite("onebit-lamb").parameters(), _megalite("lamb").parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "factor",
    [
        (0.5, 4.0, 0.1),  # the defaults
        (0.5, 4.0, 0.01),  # the per-step threshold acts
        (0.999, 1.001, 1.0),  # the bounds act
        (1.0, 1.0, 0.1),  # no rescaling: the frozen ratio alone
    ],
)
def test_onebit_lamb_compressed_phase_equals_hand_written(factor) -> None:
    want = _model()
    peaks = _hand_onebit_lamb(want, freeze=2, factor=factor)
    low, high, threshold = factor
    if threshold < 0.1:
        assert max(abs(c - 1) for c in peaks) > threshold
    if high - low < 0.01:
        assert max(peaks) > high or min(peaks) < low
    got = _megalite("onebit-lamb", freeze=2, factor=factor)
    for a, b in zip(got.parameters(), want.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_onebit_lamb_factor_moves() -> None:
    """The factor is not 1 in this test's compressed steps (so the oracle above checks it)."""
    peaks = _hand_onebit_lamb(_model(), freeze=2)
    assert max(abs(c - 1) for c in peaks) > 0.01

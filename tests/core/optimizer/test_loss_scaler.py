"""Loss scalers against hand-written sequences of (overflow?, expected scale)."""

from __future__ import annotations

import pytest

from megalite.core.optimizer.loss_scaler import ConstantLossScaler, DynamicLossScaler


def _drive(scaler, events: str) -> list[float]:
    """events: "x" = step with inf/NaN grads, "." = clean step; the scale after each."""
    out = []
    for e in events:
        scaler.update(found_inf=e == "x")
        out.append(float(scaler.scale.item()))
    return out


def test_dynamic_hysteresis_window_and_floor():
    s = DynamicLossScaler(8.0, min_scale=1.0, window=3, hysteresis=2)
    #        x: hysteresis 2 -> 1, no backoff      x: 1 -> 0, halve       x: still 0, halve
    #        ...: 3 clean steps grow x2 and refill hysteresis to 2
    #        x: 2 -> 1 keeps the scale    ..x: the overflow restarts the clean count; 1 -> 0, halve
    assert _drive(s, "xxx...x..x") == [8, 4, 2, 2, 2, 4, 4, 4, 4, 2]
    s = DynamicLossScaler(4.0, min_scale=1.0, window=1000, hysteresis=1)
    assert _drive(s, "xxxx") == [2, 1, 1, 1]  # never below --min-loss-scale


def test_hysteresis_one_halves_on_the_first_overflow():
    s = DynamicLossScaler(1024.0, hysteresis=1, window=1000)
    assert _drive(s, "..x.") == [1024, 1024, 512, 512]


def test_constant_never_changes_and_inverse_is_exact():
    s = ConstantLossScaler(128.0)
    assert _drive(s, "x.x.") == [128.0] * 4
    assert float(s.inv_scale.item()) == 1 / 128.0


def test_state_dict_round_trip_continues_identically():
    a = DynamicLossScaler(64.0, window=2, hysteresis=2)
    _drive(a, "x.")
    b = DynamicLossScaler(2.0**32, window=2, hysteresis=2)
    b.load_state_dict(a.state_dict())
    assert _drive(a, ".x.x..") == _drive(b, ".x.x..")


@pytest.mark.parametrize(
    "kwargs",
    [{"initial_scale": 0.5, "min_scale": 1.0}, {"window": 0}, {"hysteresis": 0}],
)
def test_bad_settings_name_the_parameter(kwargs):
    with pytest.raises(ValueError, match="|".join(kwargs)):
        DynamicLossScaler(**{"initial_scale": 8.0, **kwargs})

"""Loss scaling for fp16 training: a constant scale, or a dynamic one that backs off on overflow.

The loss is multiplied by ``scale`` before backward so small fp16 gradients do not underflow; the
optimizer divides the gradients by it again (``inv_scale``) before the update. A step whose
gradients hold an inf or a NaN is skipped, and ``update(found_inf=True)`` is called:

- ``ConstantLossScaler`` (a run's ``loss_scale`` S) keeps ``S`` whatever happens.
- ``DynamicLossScaler`` (``initial_scale``, ``window``, ``hysteresis``, ``min_scale``: a run's
  ``initial_loss_scale``, ``loss_scale_window``, ``hysteresis``, ``min_loss_scale``): each
  overflow decrements a hysteresis counter, and once it reaches 0 the scale is multiplied by
  ``backoff_factor`` (0.5; never below ``min_scale``). ``window`` consecutive clean steps multiply
  the scale by ``growth_factor`` (2) and refill the hysteresis counter. An overflow also restarts
  the count of clean steps. ``update`` never reads the device.
"""

from __future__ import annotations

import torch


class LossScaler:
    """The interface both scalers share; ``scale`` is a 1-element fp32 tensor on ``device``."""

    def __init__(self, scale: float, *, device: torch.device | None = None):
        if not scale > 0:
            raise ValueError(f"loss scale must be > 0, got {scale}")
        self._scale = torch.tensor([float(scale)], dtype=torch.float32, device=device)

    @property
    def scale(self) -> torch.Tensor:
        return self._scale

    @property
    def inv_scale(self) -> torch.Tensor:
        return self._scale.double().reciprocal().float()

    def update(self, found_inf: bool) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict:
        return {"scale": float(self._scale.item())}

    def load_state_dict(self, state: dict) -> None:
        self._scale.fill_(float(state["scale"]))


class ConstantLossScaler(LossScaler):
    """A fixed ``loss_scale``: the scale never changes (overflowing steps are still skipped)."""

    def update(self, found_inf: bool) -> None:
        del found_inf


class DynamicLossScaler(LossScaler):
    def __init__(
        self,
        initial_scale: float = 2.0**32,
        *,
        min_scale: float = 1.0,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        window: int = 1000,
        hysteresis: int = 2,
        device: torch.device | None = None,
    ):
        super().__init__(initial_scale, device=device)
        if not min_scale > 0:
            raise ValueError(f"min_scale must be > 0, got {min_scale}")
        if initial_scale < min_scale:
            raise ValueError(f"initial_scale {initial_scale} is below min_scale {min_scale}")
        if growth_factor <= 1.0 or not 0.0 < backoff_factor < 1.0:
            raise ValueError(
                f"need growth_factor > 1 and 0 < backoff_factor < 1, got {growth_factor}, "
                f"{backoff_factor}"
            )
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if hysteresis < 1:
            raise ValueError(f"hysteresis must be >= 1, got {hysteresis}")
        self.min_scale, self.growth_factor, self.backoff_factor = (
            min_scale,
            growth_factor,
            backoff_factor,
        )
        self.window, self.hysteresis = window, hysteresis
        self._clean_steps = 0  # consecutive steps without overflow
        self._hysteresis_left = hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self._clean_steps = 0
            self._hysteresis_left -= 1
            if self._hysteresis_left <= 0:  # on the device: no host sync
                self._scale.mul_(self.backoff_factor).clamp_(min=self.min_scale)
            return
        self._clean_steps += 1
        if self._clean_steps == self.window:
            self._clean_steps = 0
            self._hysteresis_left = self.hysteresis
            self._scale.mul_(self.growth_factor)

    def state_dict(self) -> dict:
        return {
            "scale": float(self._scale.item()),
            "clean_steps": self._clean_steps,
            "hysteresis_left": self._hysteresis_left,
        }

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self._clean_steps = int(state["clean_steps"])
        self._hysteresis_left = int(state["hysteresis_left"])

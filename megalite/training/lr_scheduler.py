"""Learning-rate schedule: linear warmup, then decay to ``min_lr``, as Megatron-LM computes it.

Megatron counts the schedule in samples (``OptimizerParamScheduler`` steps by the global batch
size). Here ``n`` counts optimizer steps (the iteration the next step belongs to, from 0), ``B`` is
the samples one step consumes (``samples_per_step``, the global batch size), ``W`` the warmup length
and ``D`` the decay length, both in steps and possibly fractional (``--lr-warmup-fraction 0.25`` of
10 iterations is W = 2.5, i.e. 2.5 B samples):

    W > 0 and n <= W   lr = warmup_init + (max_lr - warmup_init) * n / W
    constant           lr = max_lr
    n > D              lr = min_lr                       (every other style, inverse-sqrt included)
    otherwise          r = (n - W) / (D - W)
                       linear:    lr = min_lr + (max_lr - min_lr) * (1 - r)
                       cosine:    lr = min_lr + (max_lr - min_lr) * (1 + cos(pi r)) / 2
                       inv-sqrt:  lr = max(min_lr, max_lr * sqrt(max(W B, 1) / max(n B, 1)))

With a constant B every formula is the same counted in samples or in steps, except the two clamps
of inverse-square-root, which Megatron applies to sample counts; hence ``samples_per_step``. A
caller that counts samples itself (a batch-size ramp) builds the schedule in samples with
``samples_per_step=1`` and calls ``step(samples)``. The first step of a warmed-up run uses
``warmup_init`` (0 by default), as in Megatron-LM. Under a batch-size schedule
(``megalite.training.microbatches``) the trainer sets ``increment`` to each step's batch over the
final batch B, so ``n`` stays "samples consumed / B", possibly fractional, and the schedule is
Megatron's in samples.

Per-group rates (``--decoupled-lr`` / ``--decoupled-min-lr``): a param group holding
``max_lr`` / ``min_lr`` keys follows the same formulas with its own ``max_lr`` and ``min_lr`` (the
warmup still starts from ``warmup_init``), as Megatron's ``OptimizerParamScheduler`` reads them
from its groups. They are read once, at construction, so an optimizer checkpoint whose groups lack
them cannot turn them off.
"""

from __future__ import annotations

import math

DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")


class LRScheduler:
    """Writes the learning rate into ``optimizer.param_groups`` at construction and on each
    ``step()``; ``state_dict`` / ``load_state_dict`` round-trip the position and the settings."""

    def __init__(
        self,
        optimizer,
        *,
        max_lr: float,
        min_lr: float,
        warmup_iters: float,
        decay_iters: float,
        decay_style: str,
        warmup_init: float = 0.0,
        samples_per_step: int = 1,
    ):
        if decay_style not in DECAY_STYLES:
            raise ValueError(f"--lr-decay-style must be one of {DECAY_STYLES}, got {decay_style!r}")
        if not 0.0 <= min_lr <= max_lr:
            raise ValueError(f"need 0 <= --min-lr ({min_lr}) <= --lr ({max_lr})")
        if warmup_iters < 0 or decay_iters <= 0:
            raise ValueError(
                f"need --lr-warmup-iters >= 0 and --lr-decay-iters > 0, got {warmup_iters}, "
                f"{decay_iters}"
            )
        if warmup_iters > decay_iters:
            raise ValueError(
                f"--lr-warmup-iters {warmup_iters} exceeds --lr-decay-iters {decay_iters}"
            )
        if samples_per_step < 1:
            raise ValueError(f"samples_per_step must be >= 1, got {samples_per_step}")
        self.optimizer = optimizer
        self.max_lr, self.min_lr, self.warmup_init = max_lr, min_lr, warmup_init
        self.warmup_iters, self.decay_iters, self.decay_style = (
            warmup_iters,
            decay_iters,
            decay_style,
        )
        self.samples_per_step = samples_per_step
        self.num_steps: int | float = 0
        self.increment: int | float = 1  # what step() adds (batch schedules: batch / final batch)
        # per group (max_lr, min_lr) or None where the group follows the run's rates
        self.group_rates: list[tuple[float | None, float | None]] = [
            (g.get("max_lr"), g.get("min_lr")) for g in optimizer.param_groups
        ]
        for max_g, min_g in self.group_rates:
            lo = min_lr if min_g is None else min_g
            hi = max_lr if max_g is None else max_g
            if not 0.0 <= lo <= hi:
                raise ValueError(f"need 0 <= --decoupled-min-lr ({lo}) <= --decoupled-lr ({hi})")
        self._apply()

    def get_lr(self, max_lr: float | None = None, min_lr: float | None = None) -> float:
        """The rate at ``num_steps`` for a group with these rates (default: the run's)."""
        max_lr = self.max_lr if max_lr is None else max_lr
        min_lr = self.min_lr if min_lr is None else min_lr
        n, w, d = self.num_steps, self.warmup_iters, self.decay_iters
        if w > 0 and n <= w:
            return self.warmup_init + (max_lr - self.warmup_init) * n / w
        if self.decay_style == "constant":
            return max_lr
        if n > d:
            return min_lr
        if self.decay_style == "inverse-square-root":  # Megatron's clamps are on sample counts
            b = self.samples_per_step
            return max(min_lr, max_lr * math.sqrt(max(w * b, 1) / max(n * b, 1)))
        ratio = (n - w) / (d - w) if d > w else 1.0
        if self.decay_style == "linear":
            coeff = 1.0 - ratio
        else:  # cosine
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return min_lr + coeff * (max_lr - min_lr)

    def _apply(self) -> None:
        for group, rates in zip(self.optimizer.param_groups, self.group_rates):
            group["lr"] = self.get_lr(*rates)

    def step(self, increment: int | float | None = None) -> None:
        self.num_steps += self.increment if increment is None else increment
        self._apply()

    def state_dict(self) -> dict:
        return {
            "max_lr": self.max_lr,
            "min_lr": self.min_lr,
            "warmup_init": self.warmup_init,
            "warmup_iters": self.warmup_iters,
            "decay_iters": self.decay_iters,
            "decay_style": self.decay_style,
            "num_steps": self.num_steps,
        }

    def load_state_dict(self, state: dict) -> None:
        for key in ("max_lr", "min_lr", "warmup_init", "warmup_iters", "decay_iters"):
            setattr(self, key, state[key])
        self.decay_style = state["decay_style"]
        n = state["num_steps"]  # fractional under a batch-size schedule
        self.num_steps = int(n) if float(n).is_integer() else float(n)
        self._apply()

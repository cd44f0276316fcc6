"""Learning-rate schedule: linear warmup, then decay to ``min_lr``.

With ``n`` the number of optimizer steps taken so far (the iteration the next step belongs to,
counting from 0), ``W`` = ``--lr-warmup-iters`` and ``D`` = ``--lr-decay-iters``:

    n <= W (W > 0)   lr = warmup_init + (max_lr - warmup_init) * n / W
    n > D            lr = min_lr
    otherwise        r = (n - W) / (D - W)
                     constant:             lr = max_lr
                     linear:               lr = min_lr + (max_lr - min_lr) * (1 - r)
                     cosine:               lr = min_lr + (max_lr - min_lr) * (1 + cos(pi r)) / 2
                     inverse-square-root:  lr = max(min_lr, max_lr * sqrt(max(W,1) / max(n,1)))

so the first step of a warmed-up run uses ``warmup_init`` (0 by default), as in Megatron-LM.
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
        warmup_iters: int,
        decay_iters: int,
        decay_style: str,
        warmup_init: float = 0.0,
    ):
        if decay_style not in DECAY_STYLES:
            raise ValueError(f"--lr-decay-style must be one of {DECAY_STYLES}, got {decay_style!r}")
        if not 0.0 <= min_lr <= max_lr:
            raise ValueError(f"need 0 <= --min-lr ({min_lr}) <= --lr ({max_lr})")
        if warmup_iters < 0 or decay_iters < 1:
            raise ValueError(
                f"need --lr-warmup-iters >= 0 and --lr-decay-iters >= 1, got {warmup_iters}, "
                f"{decay_iters}"
            )
        if warmup_iters > decay_iters:
            raise ValueError(
                f"--lr-warmup-iters {warmup_iters} exceeds --lr-decay-iters {decay_iters}"
            )
        self.optimizer = optimizer
        self.max_lr, self.min_lr, self.warmup_init = max_lr, min_lr, warmup_init
        self.warmup_iters, self.decay_iters, self.decay_style = (
            warmup_iters,
            decay_iters,
            decay_style,
        )
        self.num_steps = 0
        self._apply()

    def get_lr(self) -> float:
        n, w, d = self.num_steps, self.warmup_iters, self.decay_iters
        if w > 0 and n <= w:
            return self.warmup_init + (self.max_lr - self.warmup_init) * n / w
        if self.decay_style == "constant":
            return self.max_lr
        if self.decay_style == "inverse-square-root":
            return max(self.min_lr, self.max_lr * math.sqrt(max(w, 1)) / math.sqrt(max(n, 1)))
        if n > d:
            return self.min_lr
        ratio = (n - w) / (d - w) if d > w else 1.0
        if self.decay_style == "linear":
            coeff = 1.0 - ratio
        else:  # cosine
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def _apply(self) -> None:
        lr = self.get_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def step(self, increment: int = 1) -> None:
        self.num_steps += increment
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
        self.num_steps = int(state["num_steps"])
        self._apply()

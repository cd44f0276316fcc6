"""0/1 Adam (Lu et al., 2022), with DeepSpeed's knob names:
- variance: updated (a ``PHASE_FULL`` step) at step 1 and then at growing intervals: the interval
  starts at 1 and doubles after every ``var_update_scaler`` updates; never after
  ``var_freeze_step``. Every other step is compressed or local;
- local steps: up to ``var_freeze_step`` every step communicates; after it, a sync every ``k``
  steps with ``k = min(2^((t - var_freeze_step) // local_step_scaler), local_step_clipper)``.
  Between syncs each rank steps with its own momentum and accumulates ``u += lr_t m``
  (``lr_t = lr / bc1``); at a sync ``u`` is averaged by the compressed all-reduce and every rank
  lands on ``w = anchor - u / (sqrt(v / bc2) + eps)`` (``anchor``: the weights at the last sync,
  weight-decayed each step), with ``m = u / sum(lr_t)``.

The phases (``PHASE_*``) and the compressed all-reduce of the momentum are ``compressed``'s.
"""

from __future__ import annotations

import torch

from megalite.core.optimizer.compressed import (
    PHASE_COMPRESSED,
    PHASE_FULL,
    PHASE_LOCAL,
    CompressedMixin,
    adam_denominator,
)


class ZeroOneAdam(CompressedMixin, torch.optim.AdamW):
    """0/1 Adam (the module docstring): the variance updated on a doubling schedule, the
    momentum compressed, local steps after ``var_freeze_step``."""

    def __init__(
        self,
        params,
        *,
        var_freeze_step: int,
        var_update_scaler: int,
        local_step_scaler: int,
        local_step_clipper: int,
        dp_group,
        expert_dp_group=None,
        **adamw,
    ):
        super().__init__(params, **adamw)
        self.var_freeze_step, self.var_update_scaler = var_freeze_step, var_update_scaler
        self.local_step_scaler, self.local_step_clipper = local_step_scaler, local_step_clipper
        self._init_compression(dp_group=dp_group, expert_dp_group=expert_dp_group)
        self.var_updates, self.next_var_step, self.last_sync = 0, 1, 0

    def _sync_interval(self, t: int) -> int:
        if t <= self.var_freeze_step:
            return 1
        doublings = (t - self.var_freeze_step) // self.local_step_scaler
        return min(2 ** min(doublings, 30), self.local_step_clipper)

    def phase_of(self, t: int) -> int:
        if t <= self.var_freeze_step and t == self.next_var_step:
            return PHASE_FULL
        return PHASE_COMPRESSED if t - self.last_sync >= self._sync_interval(t) else PHASE_LOCAL

    def _extra_state(self) -> dict:
        schedule = {"var_updates": self.var_updates, "next_var_step": self.next_var_step}
        return {**super()._extra_state(), **schedule, "last_sync": self.last_sync}

    def _load_extra_state(self, extra: dict) -> None:
        super()._load_extra_state(extra)
        self.var_updates, self.next_var_step = extra["var_updates"], extra["next_var_step"]
        self.last_sync = extra["last_sync"]

    def _local(self, p: torch.Tensor) -> dict:
        """The accumulated update ``u`` and the ``anchor`` (weights at the last sync)."""
        state = self.state[p]
        if "local_update" not in state:
            state["local_update"] = torch.zeros_like(p)
            state["anchor"] = p.detach().clone()
            state["lr_sum"] = torch.zeros((), dtype=torch.float32)
        return state

    def _variance_step(self) -> None:
        """AdamW's step on the averaged grads, the variance's bias correction counting its own
        updates (``var_updates + 1``), not the steps: between its updates ``v`` stood still."""
        for group in self.param_groups:
            b1, b2 = group["betas"]
            lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
            for p in group["params"]:
                state, g = self.state[p], p.grad
                state["step"] += 1
                state["exp_avg"].mul_(b1).add_(g, alpha=1 - b1)
                state["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
                p.mul_(1 - lr * wd)
                bc1 = 1 - b1 ** float(state["step"])
                denom = adam_denominator(state, b2, eps, self.var_updates + 1)
                p.addcdiv_(state["exp_avg"], denom, value=-lr / bc1)

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None
        t = self.step_count = self.step_count + 1
        self.last_phase = self.phase_of(t)
        if self.last_phase == PHASE_FULL:
            if self.var_updates + 1 == t:  # every step so far updated v: AdamW's own step
                super().step()
            else:
                self._variance_step()
            self.var_updates += 1
            self.next_var_step = t + 2 ** (self.var_updates // self.var_update_scaler)
            self.last_sync = t
            for group in self.param_groups:
                for p in group["params"]:
                    local = self._local(p)
                    local["anchor"].copy_(p)
                    local["local_update"].zero_()
                    local["lr_sum"].zero_()
            return None
        self._advance_momentum()
        for group in self.param_groups:
            b1, b2 = group["betas"]
            lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
            for p in group["params"]:
                state, local = self.state[p], self._local(p)
                lr_t = lr / (1 - b1 ** float(state["step"]))
                p.mul_(1 - lr * wd)
                local["anchor"].mul_(1 - lr * wd)
                denom = adam_denominator(state, b2, eps, self.var_updates)
                p.addcdiv_(state["exp_avg"], denom, value=-lr_t)
                local["local_update"].add_(state["exp_avg"], alpha=lr_t)
                local["lr_sum"] += lr_t
        if self.last_phase == PHASE_LOCAL:
            return None
        self.compressor(lambda p: self.state[p]["local_update"])
        self.last_sync = t
        for group in self.param_groups:
            b2, eps = group["betas"][1], group["eps"]
            for p in group["params"]:
                state = self.state[p]
                u = state["local_update"]
                denom = adam_denominator(state, b2, eps, self.var_updates)
                p.copy_(state["anchor"]).addcdiv_(u, denom, value=-1)
                state["exp_avg"].copy_(u / state["lr_sum"])
                state["anchor"].copy_(p)
                u.zero_()
                state["lr_sum"].zero_()
        return None

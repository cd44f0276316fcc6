"""The communication-compressed optimizers: 1-bit Adam, 0/1 Adam and 1-bit LAMB, as inner torch
optimizers over fp32 masters (``compressed_optimizer.CompressedOptimizer`` wraps them in the
mixed-precision family). Their momentum, not the gradient, crosses the data-parallel group,
through ``core.distributed.compressed_allreduce`` (sign bits plus a scale per chunk, error feedback
on worker and server).

Each step is one of three phases (``PHASE_*``), decided before the step's backward so that the
data-parallel wrapper knows whether to all-reduce the grads (``full_grads_next``):

- ``PHASE_FULL``: the grads are averaged over DP as usual and the step is the plain optimizer's
  (``torch.optim.AdamW``'s own step, so bitwise the ordinary path; LAMB's for 1-bit LAMB);
- ``PHASE_COMPRESSED``: each rank's grad stays local, ``m = b1 m + (1 - b1) g_local``, the momenta
  are averaged by the compressed all-reduce, the variance is frozen;
- ``PHASE_LOCAL`` (0/1 Adam only): no communication at all, the rank updates with its own momentum.

1-bit Adam (Tang et al., 2021): ``PHASE_FULL`` for the first ``freeze_step`` steps, then
``PHASE_COMPRESSED``: ``w = w (1 - lr wd) - lr / bc1 * m / (sqrt(v / bc2) + eps)`` with Adam's
bias corrections ``bc1 = 1 - b1^t`` and ``bc2 = 1 - b2^freeze_step``: the variance is frozen with
its bias correction (AdamW's formula with ``v / bc2`` frozen). Likewise 1-bit LAMB's frozen
variance, and 0/1 Adam's ``bc2 = 1 - b2^k`` with ``k`` the variance updates so far.

1-bit LAMB (Li et al., 2021): LAMB for ``freeze_step`` steps, keeping an average of each
parameter's trust ratio (``coeff = 0.9 coeff + 0.1 trust``); then the compressed momentum, the
frozen variance, and the frozen average (clamped to the LAMB bounds) rescaled per parameter by
the paper's factor ``c`` as the trust ratio. The factor follows how far the variance has moved
since the freeze, which the frozen ratio cannot see: each compressed step reconstructs the
averaged gradient from the change of the compressed momentum, ``g = (m_t - b1 m_{t-1}) / (1 - b1)``,
updates a fresh variance with it (``v' = b2 v' + (1 - b2) g^2``, started from ``v`` at the
freeze, bias-corrected by the steps so far), and takes the largest ratio over the tensor's
entries of the frozen Adam denominator to the fresh one, ``max(sqrt(v / bc2) + eps) /
(sqrt(v' / bc2') + eps)``; that is held within ``[factor_min, factor_max]`` and within
``factor_threshold`` (relative) of the previous step's factor (1 at the freeze). The step is
``w -= lr * clamp(coeff) * c * r`` with ``r`` the update over the frozen variance. Setting
``factor_min = factor_max = 1`` gives the frozen ratio alone.

0/1 Adam (Lu et al., 2022): ``zero_one_adam.ZeroOneAdam``, on the same mixin and compressor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megalite.core.distributed.compressed_allreduce import CompressedAllReduce, wire_bytes
from megalite.core.optimizer.lamb import Lamb, over_whole_params, trust_ratios
from megalite.core.param_attributes import is_expert_param

PHASE_FULL, PHASE_COMPRESSED, PHASE_LOCAL = 0, 1, 2
COMPRESSED_OPTIMIZERS = ("onebit-adam", "zero-one-adam", "onebit-lamb")
OPTIMIZERS = ("adam", "lamb", *COMPRESSED_OPTIMIZERS)


@dataclass(frozen=True)
class CompressionSpec:
    """The schedules of the compressed optimizers (the module docstrings here and in
    ``zero_one_adam``; DeepSpeed's defaults)."""

    freeze_step: int = 100000  # 1-bit Adam / LAMB: full-precision warm-up steps
    var_freeze_step: int = 100000  # 0/1 Adam: last step the variance may change
    var_update_scaler: int = 16  # 0/1 Adam: variance updates between doublings of their interval
    local_step_scaler: int = 32678  # 0/1 Adam: steps between doublings of the sync interval
    local_step_clipper: int = 16  # 0/1 Adam: the longest sync interval
    factor_max: float = 4.0  # 1-bit LAMB: bounds on the rescaling of the frozen trust ratio
    factor_min: float = 0.5
    factor_threshold: float = 0.1  # 1-bit LAMB: the factor's largest relative change per step


TRUST_COEFF_BETA = 0.9  # 1-bit LAMB's running average of the trust ratio during warm-up


class MomentumCompressor:
    """The compressed all-reduce of one tensor per parameter, concatenated per data-parallel
    group: dense parameters over ``dp_group``, expert ones (``expert_parallel``) over
    ``expert_dp_group``. Counts the bytes it sends (``bytes_sent``, CommLog's convention)."""

    def __init__(self, params: list[torch.Tensor], *, dp_group, expert_dp_group):
        self.parts: list[tuple[CompressedAllReduce, list[torch.Tensor]]] = []
        dense = [p for p in params if not is_expert_param(p)]
        expert = [p for p in params if is_expert_param(p)]
        for group, members in ((dp_group, dense), (expert_dp_group, expert)):
            if members:
                numel = sum(p.numel() for p in members)
                device = members[0].device
                self.parts.append((CompressedAllReduce(numel, group, device=device), members))
        self.bytes_sent = 0

    def bytes_per_call(self) -> int:
        return sum(wire_bytes(car.numel, car.n) for car, _ in self.parts)

    @torch.no_grad()
    def __call__(self, tensor_of) -> None:
        """Replace ``tensor_of(p)`` by its compressed mean over p's group, for every p."""
        for car, members in self.parts:
            flat = torch.cat([tensor_of(p).reshape(-1) for p in members])
            mean = car(flat)
            offset = 0
            for p in members:
                tensor_of(p).copy_(mean[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
        self.bytes_sent += self.bytes_per_call()

    def error_norm(self) -> torch.Tensor:
        """L2 norm of every worker and server error buffer together (fp32 0-d)."""
        total = torch.zeros(())
        for car, _ in self.parts:
            total = total + car.worker_error.square().sum().cpu()
            total = total + car.server_error.square().sum().cpu()
        return total.sqrt()

    def state_dict(self) -> list[dict]:
        return [car.state_dict() for car, _ in self.parts]

    def load_state_dict(self, states: list[dict]) -> None:
        for (car, _), state in zip(self.parts, states, strict=True):
            car.load_state_dict(state)

    def reset(self) -> None:
        for car, _ in self.parts:
            car.reset()


class CompressedMixin:
    """What the three share: the step count, the compressor, the phase, the checkpoint extras."""

    step_count: int
    compressor: MomentumCompressor

    def _init_compression(self, *, dp_group, expert_dp_group) -> None:
        params = [p for g in self.param_groups for p in g["params"]]
        self.compressor = MomentumCompressor(
            params, dp_group=dp_group, expert_dp_group=expert_dp_group
        )
        self.step_count = 0  # optimizer steps taken (skipped fp16 steps not counted)
        self.last_phase = PHASE_FULL

    def phase_of(self, t: int) -> int:
        raise NotImplementedError

    def replicas_differ(self) -> bool:
        """Whether the DP ranks' weights may differ now (between 0/1 Adam's syncs)."""
        return self.last_phase == PHASE_LOCAL

    def full_grads_next(self) -> bool:
        """Whether the next step needs the grads averaged over DP (the wrapper's all-reduce)."""
        return self.phase_of(self.step_count + 1) == PHASE_FULL

    def _extra_state(self) -> dict:
        return {
            "step_count": self.step_count,
            "last_phase": self.last_phase,
            "errors": self.compressor.state_dict(),
        }

    def _load_extra_state(self, extra: dict) -> None:
        self.step_count, self.last_phase = extra["step_count"], extra["last_phase"]
        self.compressor.load_state_dict(extra["errors"])

    def state_dict(self) -> dict:
        return {**super().state_dict(), "compression": self._extra_state()}

    def load_state_dict(self, state: dict) -> None:
        state = dict(state)
        extra = state.pop("compression")
        super().load_state_dict(state)
        self._load_extra_state(extra)

    def _moments(self, p: torch.Tensor) -> dict:
        return self.state[p]

    def _advance_momentum(self) -> None:
        """``step += 1``, ``m = b1 m + (1 - b1) g`` with the local grad, for every parameter."""
        for group in self.param_groups:
            b1 = group["betas"][0]
            for p in group["params"]:
                state = self._moments(p)
                state["step"] += 1
                state["exp_avg"].mul_(b1).add_(p.grad, alpha=1 - b1)


def adam_denominator(state: dict, b2: float, eps: float, variance_updates: int) -> torch.Tensor:
    """``sqrt(v / bc2) + eps`` with ``bc2 = 1 - b2^k``, ``k`` the updates ``v`` has had: a frozen
    variance keeps the bias correction of its last update (with the step's count instead, the
    estimate would shrink as steps pass and the step size grow: 2.3x by step 300 after a
    freeze at 50)."""
    bc2 = 1 - b2 ** float(variance_updates)
    return (state["exp_avg_sq"].sqrt() / math.sqrt(bc2)).add_(eps)


class OneBitAdam(CompressedMixin, torch.optim.AdamW):
    """1-bit Adam (module docstring): AdamW for ``freeze_step`` steps, then compressed."""

    def __init__(self, params, *, freeze_step: int, dp_group, expert_dp_group=None, **adamw):
        super().__init__(params, **adamw)
        self.freeze_step = freeze_step
        self._init_compression(dp_group=dp_group, expert_dp_group=expert_dp_group)

    def phase_of(self, t: int) -> int:
        return PHASE_FULL if t <= self.freeze_step else PHASE_COMPRESSED

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None
        self.step_count += 1
        self.last_phase = self.phase_of(self.step_count)
        if self.last_phase == PHASE_FULL:
            return super().step()
        self._advance_momentum()
        self.compressor(lambda p: self.state[p]["exp_avg"])
        for group in self.param_groups:
            b1, b2 = group["betas"]
            lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
            for p in group["params"]:
                state = self.state[p]
                p.mul_(1 - lr * wd)
                bc1 = 1 - b1 ** float(state["step"])
                denom = adam_denominator(state, b2, eps, self.freeze_step)
                p.addcdiv_(state["exp_avg"], denom, value=-lr / bc1)
        return None


class OneBitLamb(CompressedMixin, Lamb):
    """1-bit LAMB (module docstring): LAMB for ``freeze_step`` steps, then compressed with the
    frozen average trust ratio times the factor from the fresh variance."""

    def __init__(
        self,
        params,
        *,
        freeze_step: int,
        dp_group,
        expert_dp_group=None,
        factor_max: float = 4.0,
        factor_min: float = 0.5,
        factor_threshold: float = 0.1,
        **lamb,
    ):
        if not 0 < factor_min <= 1 <= factor_max or factor_threshold < 0:
            raise ValueError(
                f"need 0 < factor_min ({factor_min}) <= 1 <= factor_max ({factor_max}) and "
                f"factor_threshold ({factor_threshold}) >= 0"
            )
        super().__init__(params, **lamb)
        self.freeze_step = freeze_step
        self.factor_max, self.factor_min = factor_max, factor_min
        self.factor_threshold = factor_threshold
        self._init_compression(dp_group=dp_group, expert_dp_group=expert_dp_group)

    def phase_of(self, t: int) -> int:
        return PHASE_FULL if t <= self.freeze_step else PHASE_COMPRESSED

    def _moments(self, p: torch.Tensor) -> dict:
        return self._state(p)

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None
        self.step_count += 1
        self.last_phase = self.phase_of(self.step_count)
        if self.last_phase == PHASE_FULL:
            ratios = super().step()
            params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
            for p, trust in zip(params, ratios):
                state = self.state[p]
                previous = state.get("trust_coeff", trust)
                state["trust_coeff"] = TRUST_COEFF_BETA * previous + (1 - TRUST_COEFF_BETA) * trust
            return ratios
        previous = {p: self.state[p]["exp_avg"].clone() for p in self._params()}
        self._advance_momentum()
        self.compressor(lambda p: self.state[p]["exp_avg"])
        factors, frozen = self._factors(previous)
        work = self.updates(update_moments=False, denominators=frozen)
        missing = [(p, r) for _, p, r in work if "trust_coeff" not in self.state[p]]
        if missing:  # state resharded from another DP size: freeze the ratio of this step
            ratios = trust_ratios(
                *map(list, zip(*missing)),
                tp_group=self.tp_group,
                min_trust_ratio=self.min_trust_ratio,
                max_trust_ratio=self.max_trust_ratio,
            )
            for (p, _), trust in zip(missing, ratios):
                self.state[p]["trust_coeff"] = trust
        for group, p, r in work:
            trust = self.state[p]["trust_coeff"].clamp(self.min_trust_ratio, self.max_trust_ratio)
            p.add_(r * (trust * factors[p]), alpha=-group["lr"])
        return None

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"] if p.grad is not None]

    def _factors(self, previous: dict) -> tuple[dict, dict]:
        """The rescaling of each parameter's frozen trust ratio (module docstring), and the
        frozen Adam denominators it compared (the step divides by them): the fresh variance
        advances with the gradient reconstructed from the averaged momentum; the largest ratio
        of the denominators is taken over the whole parameter (max over ``tp_group`` for
        tensor-parallel shards)."""
        params, peaks, denominators = self._params(), [], {}
        for group in self.param_groups:
            b1, b2 = group["betas"]
            eps = group["eps"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "fresh_exp_avg_sq" not in state:  # the first compressed step, or resharded
                    state["fresh_exp_avg_sq"] = state["exp_avg_sq"].clone()
                    state["trust_factor"] = torch.ones((), dtype=torch.float32, device=p.device)
                g = (state["exp_avg"] - b1 * previous[p]) / (1 - b1)
                fresh = state["fresh_exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
                frozen = denominators[p] = adam_denominator(state, b2, eps, self.freeze_step)
                bc2 = 1 - b2 ** float(state["step"])
                peaks.append((frozen / (fresh.sqrt() / math.sqrt(bc2)).add_(eps)).max().float())
        if not params:
            return {}, {}
        peaks = over_whole_params(
            torch.stack(peaks), params, tp_group=self.tp_group, op=dist.ReduceOp.MAX
        )
        out = {}
        for p, peak in zip(params, peaks.unbind(0)):
            state = self.state[p]
            last = state["trust_factor"]
            factor = peak.clamp(self.factor_min, self.factor_max)
            step = self.factor_threshold
            factor = torch.minimum(torch.maximum(factor, last * (1 - step)), last * (1 + step))
            state["trust_factor"] = factor
            out[p] = factor
        return out, denominators

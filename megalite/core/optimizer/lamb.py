"""LAMB (You et al., 2020, "Large Batch Optimization for Deep Learning"): Adam's update per
parameter tensor, scaled by the trust ratio ``||w|| / ||update||``.

For each parameter ``w`` with grad ``g`` at step ``t`` (1-based):

    m = b1 m + (1 - b1) g;   v = b2 v + (1 - b2) g^2
    r = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) + weight_decay * w
    trust = clamp(||w|| / ||r||, min_trust_ratio, max_trust_ratio)   (1 when either norm is 0)
    w = w - lr * trust * r

The state has Adam's keys (``step``, ``exp_avg``, ``exp_avg_sq``), so checkpoints and the full
state format (``full_state_format``) treat it as Adam's. Norms are of the whole parameter: those of
tensor-parallel shards (``tensor_model_parallel``) are summed over ``tp_group`` in one all-reduce.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megalite.core.groups import group_size
from megalite.core.param_attributes import is_tensor_parallel


def over_whole_params(values: torch.Tensor, params: list[torch.Tensor], *, tp_group, op=None):
    """``values`` (a row per parameter) with the rows of tensor-parallel shards reduced over
    ``tp_group`` by ``op`` (default a sum) in one all-reduce, so each stands for its whole
    parameter; the rows of replicated parameters are returned as they are."""
    split = torch.tensor([is_tensor_parallel(p) for p in params], device=values.device)
    if group_size(tp_group) <= 1 or not bool(split.any()):
        return values
    split = split.view(-1, *([1] * (values.dim() - 1)))
    shard = torch.where(split, values, torch.zeros_like(values))
    dist.all_reduce(shard, op=op or dist.ReduceOp.SUM, group=tp_group)
    return torch.where(split, shard, values)


def trust_ratios(
    params: list[torch.Tensor],
    updates: list[torch.Tensor],
    *,
    tp_group=None,
    min_trust_ratio: float,
    max_trust_ratio: float,
) -> list[torch.Tensor]:
    """``clamp(||w|| / ||r||)`` per parameter (1 where either norm is 0), whole-parameter norms."""
    if not params:
        return []
    squares = torch.stack(
        [
            torch.stack([p.float().square().sum(), r.float().square().sum()])
            for p, r in zip(params, updates)
        ]
    )  # [n, 2]
    w, r = over_whole_params(squares, params, tp_group=tp_group).sqrt().unbind(1)
    ratio = torch.where((w > 0) & (r > 0), w / r, torch.ones_like(w))
    return list(ratio.clamp(min_trust_ratio, max_trust_ratio).unbind(0))


class Lamb(torch.optim.Optimizer):
    """LAMB over fp32 parameters (module docstring); ``tp_group``: where TP shards' norms add."""

    def __init__(
        self,
        params,
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        min_trust_ratio: float = 0.0,
        max_trust_ratio: float = 10.0,
        tp_group=None,
    ):
        if not 0 <= min_trust_ratio <= max_trust_ratio:
            raise ValueError(
                f"need 0 <= min_trust_ratio ({min_trust_ratio}) <= max_trust_ratio "
                f"({max_trust_ratio})"
            )
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)
        self.min_trust_ratio, self.max_trust_ratio = min_trust_ratio, max_trust_ratio
        self.tp_group = tp_group

    def _state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        return state

    def updates(
        self,
        *,
        update_moments: bool = True,
        variance_updates: int | None = None,
        denominators: dict | None = None,
    ) -> list[tuple[dict, torch.Tensor, torch.Tensor]]:
        """``(group, param, r)`` for every parameter with a grad (``r`` before the trust ratio);
        with ``update_moments`` the step and both moments advance first (LAMB's own step).
        ``variance_updates``: the updates a frozen variance had (its bias correction's count;
        default the step's). ``denominators``: ``sqrt(v_hat) + eps`` per parameter, when the
        caller has computed them already."""
        out = []
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self._state(p)
                if update_moments:
                    state["step"] += 1
                    state["exp_avg"].mul_(b1).add_(p.grad, alpha=1 - b1)
                    state["exp_avg_sq"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                t = float(state["step"])
                m_hat = state["exp_avg"] / (1 - b1**t)
                if denominators is None:
                    k = t if variance_updates is None else float(variance_updates)
                    denominator = (state["exp_avg_sq"] / (1 - b2**k)).sqrt() + group["eps"]
                else:
                    denominator = denominators[p]
                r = m_hat / denominator
                if group["weight_decay"]:
                    r = r + group["weight_decay"] * p
                out.append((group, p, r))
        return out

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "LAMB takes no closure"
        work = self.updates()
        ratios = trust_ratios(
            [p for _, p, _ in work],
            [r for _, _, r in work],
            tp_group=self.tp_group,
            min_trust_ratio=self.min_trust_ratio,
            max_trust_ratio=self.max_trust_ratio,
        )
        for (group, p, r), trust in zip(work, ratios):
            p.add_(r * trust, alpha=-group["lr"])
        return ratios

"""The compressed optimizers (``compressed``: 1-bit Adam, 0/1 Adam, 1-bit LAMB) in the
mixed-precision family: masters, loss scaling, clipping and the fp16 skip as
``UnshardedOptimizer``, plus the one thing they need of the data-parallel wrapper.

Before each step's backward the wrapper must know whether to average the grads over DP: after
every step (and at construction, and after a load) this optimizer asks its inner one
(``full_grads_next``) and sets ``DistributedDataParallel.set_grad_reduce``. In a compressed or
local step the grads are the rank's own, so:

- the inf/NaN flag (fp16) is max-reduced over the DP groups too: every rank skips together;
- clipping (``clip_grad > 0``) scales every rank's local grad by one factor, the one Adam's global
  clip gives the DP-averaged grad: ``min(1, clip_grad / |gbar|)`` with ``|gbar|`` estimated by a
  count sketch all-reduced over DP (``sketched_norm``; 4 KiB more per step). A rank's own norm is
  larger than the mean's by the gradient noise (1.5-2.4 against 1.0-1.2 in
  ``tools/bench/bench_onebit.py``): clipping by it would take steps about half as large as Adam's,
  and unequal across ranks. The estimate is the norm returned (and logged). In 0/1 Adam's local
  steps, which communicate nothing, ``|gbar|`` is the rank's own norm times the ratio
  ``|gbar| / rms_r |g_r|`` of the last step that communicated (``noise_ratio``). Without clipping
  the norm is the rank's own and nothing more is sent.
"""

from __future__ import annotations

import logging

import torch

from megalite.core.distributed.data_parallel import DistributedDataParallel
from megalite.core.groups import group_size
from megalite.core.optimizer.compressed import PHASE_LOCAL, OneBitAdam, OneBitLamb
from megalite.core.optimizer.mixed_precision import StepGrads
from megalite.core.optimizer.sketched_norm import sketched_mean_sq_norm
from megalite.core.optimizer.unsharded_optimizer import UnshardedOptimizer
from megalite.core.optimizer.zero_one_adam import ZeroOneAdam

logger = logging.getLogger(__name__)

CompressedInner = OneBitAdam | OneBitLamb | ZeroOneAdam
_FULL_STATE_KEYS = ("step", "exp_avg", "exp_avg_sq")  # carried by full_state_dict


class CompressedOptimizer(UnshardedOptimizer):
    """``UnshardedOptimizer`` whose ``build_inner`` returns a compressed optimizer; ``model`` is
    the ``DistributedDataParallel`` wrapper whose grad reduction it switches (a bare module in a
    single-process run)."""

    optimizer: CompressedInner

    def __init__(self, param_groups: list[dict], build_inner, *, model, **kwargs):
        super().__init__(param_groups, build_inner, model=model, **kwargs)
        self.model = model
        self.dp_groups = (
            (model.dp_group, model.expert_dp_group)
            if isinstance(model, DistributedDataParallel)
            else (None, None)
        )
        # |gbar| / rms of the ranks' own norms at the last step that communicated (local steps)
        self.noise_ratio = torch.ones((), device=self._device)
        self._sync_phase()

    def _sync_phase(self) -> None:
        if isinstance(self.model, DistributedDataParallel):
            self.model.set_grad_reduce(self.optimizer.full_grads_next())

    def _inf_groups(self) -> list:
        groups = super()._inf_groups()
        if self.optimizer.full_grads_next():
            return groups
        return [*groups, self.dp_groups[0], *(self.dp_groups[1:] if self.has_experts else ())]

    def _grad_norm(self, grads: StepGrads) -> torch.Tensor:
        """The averaged grad's norm in a compressed or local step that clips (module docstring);
        else the base's: the norm of the grads this rank holds."""
        inner = self.optimizer
        if self.clip_grad <= 0 or inner.full_grads_next():
            return super()._grad_norm(grads)
        if inner.phase_of(inner.step_count + 1) == PHASE_LOCAL:
            return super()._grad_norm(grads) * self.noise_ratio
        mean_sq, own_sq = sketched_mean_sq_norm(
            grads.counted,
            dp_group=self.dp_groups[0],
            groups=self.reduce_groups,
            seed=inner.step_count + 1,
            device=self._device,
        )
        if self.has_experts:
            expert_mean_sq, expert_own_sq = sketched_mean_sq_norm(
                grads.counted_expert,
                dp_group=self.dp_groups[1],
                groups=self.expert_reduce_groups,
                seed=inner.step_count + 1,
                device=self._device,
            )
            mean_sq, own_sq = mean_sq + expert_mean_sq, own_sq + expert_own_sq
        self.noise_ratio = (mean_sq / own_sq.clamp(min=torch.finfo(torch.float32).tiny)).sqrt()
        return mean_sq.sqrt()

    @torch.no_grad()
    def step(self):
        result = super().step()
        self._sync_phase()
        return result

    # --- what the logs read -----------------------------------------------------------------------

    @property
    def phase(self) -> int:
        """The last step's phase (``compressed.PHASE_*``: 0 full, 1 compressed, 2 local)."""
        return self.optimizer.last_phase

    def compression_error_norm(self) -> torch.Tensor:
        return self.optimizer.compressor.error_norm()

    def take_bytes_sent(self) -> int:
        """Bytes the compressed all-reduce sent since the last call (CommLog's convention)."""
        sent, self.optimizer.compressor.bytes_sent = self.optimizer.compressor.bytes_sent, 0
        return sent

    def comm_scalars(self) -> dict[str, float]:
        """``compression-phase`` (0 full, 1 compressed, 2 local), ``compression-error-norm``
        (worker and server buffers together) and ``compressed-bytes-sent`` since the last call
        (reads the error norm on the host)."""
        return {
            "compression-phase": float(self.phase),
            "compression-error-norm": float(self.compression_error_norm()),
            "compressed-bytes-sent": float(self.take_bytes_sent()),
        }

    # --- checkpoints ------------------------------------------------------------------------------

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self._sync_phase()

    def full_state_dict(self, *, copy: bool = True) -> dict:
        sd = super().full_state_dict(copy=copy)
        sd["step"] = self.optimizer.step_count
        return sd

    @torch.no_grad()
    def load_full_state_dict(self, sd: dict) -> None:
        """The layout-independent state: the moments and the step; the rest comes from
        ``load_dp_rank_state`` (the same DP size) or restarts from zero (another one)."""
        super().load_full_state_dict(sd)
        self.optimizer.step_count = int(sd["step"])
        self.optimizer.compressor.reset()
        self._sync_phase()

    def dp_rank_state(self) -> dict:
        """This DP rank's error feedback, the phase schedule, and the per-parameter entries that
        are not Adam's moments (1-bit LAMB's frozen trust ratio, fresh variance and factor, 0/1
        Adam's local update and anchor), by master index; the masters themselves when the DP
        replicas differ (saved between 0/1 Adam's syncs: the model file holds DP rank 0's)."""
        inner = self.optimizer
        extra = {}
        differ = inner.replicas_differ()  # 0/1 Adam between syncs: the momentum is the rank's
        for i, master in enumerate(self.master_params):
            state = inner.state[master].items()
            own = {k: v for k, v in state if differ or k not in _FULL_STATE_KEYS}
            if own:
                extra[i] = own
        state = {"dp_size": self._dp_size(), **inner._extra_state(), "params": extra}
        state["noise_ratio"] = self.noise_ratio.detach().clone()
        if differ:  # and so are the weights
            state["masters"] = [m.detach().clone() for m in self.master_params]
        return state

    def _dp_size(self) -> int:
        return group_size(self.dp_groups[0])

    def load_dp_rank_state(self, state: dict | None) -> None:
        inner = self.optimizer
        if state is None or state["dp_size"] != self._dp_size():
            if inner.step_count > 0:
                logger.warning(
                    "%s: the error-feedback buffers and local-step state restart from zero (the "
                    "checkpoint was saved at another data-parallel size)",
                    type(inner).__name__,
                )
            return
        inner._load_extra_state({k: v for k, v in state.items() if k not in ("dp_size", "params")})
        if "noise_ratio" in state:  # else 1 (the rank's own norm) until a step communicates
            self.noise_ratio = state["noise_ratio"].to(self._device)
        for i, own in state["params"].items():
            inner.state[self.master_params[i]].update(own)
        if "masters" in state:
            for master, saved in zip(self.master_params, state["masters"], strict=True):
                master.data.copy_(saved)
            self._update_model_params()
        self._sync_phase()

"""The mixed-precision optimizer family: what the plain and the ZeRO optimizer share.

Both run a torch optimizer (AdamW) over fp32 *master* parameters (an fp32 model parameter is its
own master; a bf16 / fp16 one gets an fp32 copy, rounded back into the model after each update, so
small updates are not lost to 16-bit rounding). Gradients are read from ``param.main_grad`` (the
data-parallel grad buffer, ``megalite.core.distributed.grad_buffer``). One ``step()``:

1. fp32 grads (``_prepare_grads``: views when the buffer is fp32, else fp32 copies);
2. with a loss scaler (fp16): multiply by ``1/scale`` and look for inf/NaN, the flag max-reduced
   over ``reduce_groups`` so every rank takes the same decision; on overflow the scaler backs off
   and the step is skipped (``(False, None, None)``);
3. the global grad norm over ``reduce_groups``, each parameter counted once
   (``megalite.core.optimizer.grad_norm``), and clipping (``clip_grad > 0``);
4. the inner optimizer's step, then masters -> model params (``_update_model_params``).

``step()`` returns ``(update_successful, grad_norm, num_zeros_in_grad)``: a bool, an fp32 0-d
tensor and an int64 0-d tensor (None unless ``count_zeros``), left on the device: without a loss
scaler a step never waits for the device. With one, the skip decision reads ``found_inf`` on the
host once per step (the only sync; Megatron does the same), since whether the inner optimizer runs
is a host decision.

``reduce_groups`` (set by the subclass): the model-parallel group for replicated state; the DP
group then the model-parallel group for ZeRO, whose ranks each hold a shard of the grads.
``expert_reduce_groups``: the same for expert (MoE) parameters (``expert_parallel``): the expert
model-parallel group ``etp x ep x pp``, preceded by ``edp`` under ZeRO. Dense and expert squares
are reduced over their own groups and added (``grad_norm``); the inf/NaN flag is max-reduced over
both; the expert reductions run only when some rank of the model holds an expert parameter
(``has_experts``, agreed once at construction).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from megalite.core.groups import group_size
from megalite.core.optimizer.full_state_format import param_names
from megalite.core.optimizer.grad_norm import (
    all_reduce_over,
    clip_grads_by_norm,
    grad_norm,
    param_is_counted,
)
from megalite.core.optimizer.loss_scaler import LossScaler
from megalite.core.param_attributes import is_expert_param, is_tensor_parallel


@dataclass
class StepGrads:
    """The fp32 grads of one step: ``all`` are unscaled and clipped; ``counted`` enter the norm
    (each parameter once); ``zeros`` enter ``num_zeros_in_grad``."""

    all: list[torch.Tensor]
    counted: list[torch.Tensor]
    zeros: list[torch.Tensor]
    counted_expert: list[torch.Tensor] = field(default_factory=list)
    zeros_expert: list[torch.Tensor] = field(default_factory=list)


class MixedPrecisionOptimizer:
    """Base of ``UnshardedOptimizer`` and ``ShardedOptimizer``; see the module docstring.

    ``model``: the wrapped model chunk, whose ``named_parameters()`` name the state (``module.``
    stripped). ``tp_rank`` / ``duplicates``: see ``grad_norm.param_is_counted``. ``loss_scaler``:
    fp16 only. Subclasses set ``optimizer`` (the inner torch optimizer), ``master_params`` and
    ``reduce_groups``.
    """

    is_sharded = False
    optimizer: torch.optim.Optimizer
    reduce_groups: tuple = ()
    expert_reduce_groups: tuple = ()
    has_experts = False

    def __init__(
        self,
        param_groups: list[dict],
        *,
        model: nn.Module,
        clip_grad: float,
        tp_rank: int,
        duplicates: Iterable[torch.Tensor] = (),
        loss_scaler: LossScaler | None = None,
        count_zeros: bool = False,
        expert_tp_rank: int = 0,
    ):
        self.clip_grad, self.tp_rank, self.expert_tp_rank = clip_grad, tp_rank, expert_tp_rank
        self.duplicates = list(duplicates)
        self.loss_scaler, self.count_zeros = loss_scaler, count_zeros
        self.model_params: list[nn.Parameter] = [p for g in param_groups for p in g["params"]]
        names = param_names(model)
        self.param_names = [names[p] for p in self.model_params]  # model_params order
        self.name_of = dict(zip(self.model_params, self.param_names))

    # --- what the training loop uses -------------------------------------------------------------

    @property
    def param_groups(self) -> list[dict]:
        """The inner optimizer's groups (the LR scheduler writes ``lr`` here)."""
        return self.optimizer.param_groups

    def get_loss_scale(self) -> torch.Tensor:
        return torch.ones(1) if self.loss_scaler is None else self.loss_scaler.scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The ``grad_scale_func`` of the schedule: ``loss * scale`` (identity without a scaler)."""
        if self.loss_scaler is None:
            return loss
        return loss * self.loss_scaler.scale.to(loss.device)

    def zero_grad(self) -> None:
        """Drop the master grads (the model grads live in the grad buffer, zeroed by its owner)."""
        for p in self.master_params:
            p.grad = None
        for p in self.model_params:
            p.grad = None

    def is_counted(self, param: nn.Parameter) -> bool:
        """Whether ``param`` enters the grad norm on this rank (each parameter counted once)."""
        return param_is_counted(
            param,
            tp_rank=self.tp_rank,
            duplicates=self.duplicates,
            expert_tp_rank=self.expert_tp_rank,
        )

    def zeros_counted(self, param: nn.Parameter) -> bool:
        """Whether ``param`` enters ``num_zeros_in_grad`` (TP-replicated ones on TP rank 0)."""
        tp_rank = self.expert_tp_rank if is_expert_param(param) else self.tp_rank
        return is_tensor_parallel(param) or tp_rank == 0

    def _agree_on_experts(self) -> None:
        """``has_experts``: whether any rank of the model holds an expert parameter (one MAX
        all-reduce at construction when expert groups are given; subclasses call it once their
        groups are set)."""
        local = any(is_expert_param(p) for p in self.model_params)
        groups = [*self.reduce_groups, *self.expert_reduce_groups]
        if not any(group_size(g) > 1 for g in groups):
            self.has_experts = local
            return
        flag = torch.tensor([1.0 if local else 0.0], device=self._device)
        self.has_experts = bool(all_reduce_over(flag, groups, dist.ReduceOp.MAX).item() > 0)

    def _split_expert(self, grads: list, params: list) -> tuple[list, list]:
        """(dense grads, expert grads) of ``grads`` by their ``params``."""
        dense = [g for g, p in zip(grads, params) if not is_expert_param(p)]
        return dense, [g for g, p in zip(grads, params) if is_expert_param(p)]

    @torch.no_grad()
    def step(self) -> tuple[bool, torch.Tensor | None, torch.Tensor | None]:
        grads = self._prepare_grads()
        if self.loss_scaler is not None:
            found_inf = self._unscale_and_check(grads.all)
            self.loss_scaler.update(found_inf)
            if found_inf:
                return False, None, None
        norm = self._grad_norm(grads)
        if self.clip_grad > 0:
            self._clip(grads, norm)
        num_zeros = self._count_zeros(grads) if self.count_zeros else None
        self._before_inner_step()
        self.optimizer.step()
        self._update_model_params()
        return True, norm, num_zeros

    # --- what subclasses provide ------------------------------------------------------------------

    def _prepare_grads(self) -> StepGrads:
        raise NotImplementedError

    def _update_model_params(self) -> None:
        raise NotImplementedError

    def _grad_norm(self, grads: StepGrads) -> torch.Tensor:
        """The global norm of the counted grads (step 3)."""
        return grad_norm(
            grads.counted,
            groups=self.reduce_groups,
            device=self._device,
            expert_grads=grads.counted_expert if self.has_experts else None,
            expert_groups=self.expert_reduce_groups,
        )

    def _clip(self, grads: StepGrads, norm: torch.Tensor) -> None:
        """Scale every grad by the clip coefficient of ``norm`` (step 3)."""
        clip_grads_by_norm(grads.all, norm, self.clip_grad)

    def _before_inner_step(self) -> None:
        """After unscaling and clipping, before the inner step (the offload's grad copies)."""

    def comm_scalars(self) -> dict[str, float]:
        """Scalars of the optimizer's own communication for the logs (the compressed ones':
        phase, error norm, bytes sent); none here."""
        return {}

    def dp_rank_state(self) -> dict | None:
        """State that differs between DP ranks and is not in ``full_state_dict`` (the compressed
        optimizers' error feedback), saved by each DP rank; None: there is none."""
        return None

    def load_dp_rank_state(self, state: dict | None) -> None:
        """Inverse of ``dp_rank_state`` after ``load_full_state_dict``; None: the checkpoint has
        none for this layout."""
        del state

    def _inf_groups(self) -> list:
        """Where the inf/NaN flag is max-reduced: every group the grad norm reduces over."""
        return [*self.reduce_groups, *(self.expert_reduce_groups if self.has_experts else ())]

    @property
    def _device(self) -> torch.device:
        return self.model_params[0].device if self.model_params else torch.device("cpu")

    # --- shared pieces ----------------------------------------------------------------------------

    def _unscale_and_check(self, grads: list[torch.Tensor]) -> bool:
        """Multiply by 1/scale in place; True if any grad on any rank of ``reduce_groups`` is
        inf/NaN. Reads the flag on the host: the one sync of an fp16 step (the skip decision)."""
        scaler = self.loss_scaler
        device = grads[0].device if grads else scaler.scale.device
        found_inf = torch.zeros(1, dtype=torch.float32, device=device)
        if grads:
            torch._amp_foreach_non_finite_check_and_unscale_(
                grads, found_inf, scaler.inv_scale.to(device)
            )
        all_reduce_over(found_inf, self._inf_groups(), dist.ReduceOp.MAX)
        return bool(found_inf.item() > 0)

    def _count_zeros(self, grads: StepGrads) -> torch.Tensor:
        """Zero elements of ``grads.zeros`` summed over ``reduce_groups`` (plus the expert ones
        over ``expert_reduce_groups``); int64 0-d, no host sync."""

        def local(tensors: list[torch.Tensor]) -> torch.Tensor:
            zeros = torch.zeros((), dtype=torch.int64, device=self._device)
            for g in tensors:
                zeros = zeros + (g == 0).sum().to(self._device)
            return zeros

        total = all_reduce_over(local(grads.zeros), self.reduce_groups)
        if self.has_experts:
            total = total + all_reduce_over(local(grads.zeros_expert), self.expert_reduce_groups)
        return total

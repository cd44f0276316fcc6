"""The optimizer wrapper: fp32 master weights, loss-scale unscaling with overflow skip, clipping.

``MixedPrecisionOptimizer`` runs a torch optimizer (AdamW) over fp32 *master* parameters:

- an fp32 model parameter is its own master (no copy);
- a bf16 / fp16 model parameter gets an fp32 master copy; after each update the master is copied
  back (rounded) into the model parameter, so small updates are not lost to bf16 rounding.

Gradients are read from ``param.main_grad`` (the data-parallel grad buffer,
``megalite.core.distributed.grad_buffer``) or ``param.grad`` when a parameter has no buffer. One
``step()``:

1. master grads <- model grads (a view when already fp32, else an fp32 copy);
2. with a loss scaler (fp16): multiply by ``1/scale`` and look for inf/NaN, the flag max-reduced
   over the model-parallel group so every rank takes the same decision; on overflow the scaler
   backs off and the step is skipped (``(False, None, None)``);
3. global grad norm over TP x PP, each parameter counted once, and clipping (``clip_grad > 0``);
4. the inner optimizer's step, then masters -> model params.

``step()`` returns ``(update_successful, grad_norm, num_zeros_in_grad)``; ``num_zeros_in_grad`` is
None unless ``count_zeros``. ZeRO-1's DistributedOptimizer (issue 5) keeps this interface.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from megalite.core.optimizer.clip_grads import clip_grad_norm
from megalite.core.optimizer.full_state import (
    ADAM_KEYS,
    adam_state_of,
    check_full_state,
    param_names,
)
from megalite.core.optimizer.loss_scaler import LossScaler
from megalite.core.tensor_parallel.mappings import group_size

_COPIED_ATTRS = ("tensor_model_parallel", "partition_dim", "sequence_parallel", "partition_stride")


def _model_grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    grad = getattr(param, "main_grad", None)
    return param.grad if grad is None else grad


class MixedPrecisionOptimizer:
    """Wraps ``build_inner(master_param_groups) -> torch.optim.Optimizer``.

    ``param_groups``: torch-style groups of *model* parameters (``{"params": [...], **options}``).
    ``mp_group`` / ``tp_rank`` / ``duplicates``: see ``clip_grads``. ``loss_scaler``: fp16 only.
    """

    is_sharded = False  # the optimizer state is whole on every DP rank

    def __init__(
        self,
        param_groups: list[dict],
        build_inner: Callable[[list[dict]], torch.optim.Optimizer],
        *,
        clip_grad: float,
        mp_group,
        tp_rank: int,
        duplicates: Iterable[torch.Tensor] = (),
        loss_scaler: LossScaler | None = None,
        count_zeros: bool = False,
    ):
        self.clip_grad, self.mp_group, self.tp_rank = clip_grad, mp_group, tp_rank
        self.duplicates = list(duplicates)
        self.loss_scaler, self.count_zeros = loss_scaler, count_zeros
        self.model_params: list[torch.nn.Parameter] = []
        self.master_params: list[torch.nn.Parameter] = []
        master_groups = []
        for group in param_groups:
            masters = []
            for p in group["params"]:
                master = p if p.dtype == torch.float32 else self._make_master(p)
                self.model_params.append(p)
                self.master_params.append(master)
                masters.append(master)
            master_groups.append({**group, "params": masters})
        self.optimizer = build_inner(master_groups)

    @staticmethod
    def _make_master(param: torch.nn.Parameter) -> torch.nn.Parameter:
        master = torch.nn.Parameter(param.detach().clone().float())
        for name in _COPIED_ATTRS:
            if hasattr(param, name):
                setattr(master, name, getattr(param, name))
        return master

    # --- what the training loop uses -------------------------------------------------------------

    @property
    def param_groups(self) -> list[dict]:
        """The inner optimizer's groups (the LR scheduler writes ``lr`` here)."""
        return self.optimizer.param_groups

    def get_loss_scale(self) -> torch.Tensor:
        if self.loss_scaler is None:
            return torch.ones(1)
        return self.loss_scaler.scale

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

    @torch.no_grad()
    def step(self) -> tuple[bool, torch.Tensor | None, int | None]:
        grads = self._copy_model_grads_to_master()
        if self.loss_scaler is not None:
            found_inf = self._unscale_and_check(grads)
            self.loss_scaler.update(found_inf)
            if found_inf:
                return False, None, None
        grad_norm = clip_grad_norm(
            self.model_params,
            grads,
            self.clip_grad,
            mp_group=self.mp_group,
            tp_rank=self.tp_rank,
            duplicates=self.duplicates,
        )
        num_zeros = self._count_zeros(grads) if self.count_zeros else None
        self.optimizer.step()
        self._copy_master_to_model_params()
        return True, grad_norm, num_zeros

    # --- the pieces -------------------------------------------------------------------------------

    def _copy_model_grads_to_master(self) -> list[torch.Tensor]:
        grads = []
        for model, master in zip(self.model_params, self.master_params):
            grad = _model_grad(model)
            if grad is None:
                grad = torch.zeros_like(master)
            master.grad = grad if grad.dtype == torch.float32 else grad.float()
            grads.append(master.grad)
        return grads

    def _unscale_and_check(self, grads: list[torch.Tensor]) -> bool:
        """Multiply by 1/scale in place; True if any grad on any model-parallel rank is inf/NaN."""
        scaler = self.loss_scaler
        device = grads[0].device if grads else scaler.scale.device
        found_inf = torch.zeros(1, dtype=torch.float32, device=device)
        inv_scale = scaler.inv_scale.to(device)
        if grads:
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
        if group_size(self.mp_group) > 1:
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=self.mp_group)
        return bool(found_inf.item() > 0)

    def _count_zeros(self, grads: list[torch.Tensor]) -> int:
        zeros = torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else None)
        for p, g in zip(self.model_params, grads):
            if getattr(p, "tensor_model_parallel", False) or self.tp_rank == 0:
                zeros = zeros + (g == 0).sum()
        if group_size(self.mp_group) > 1:
            dist.all_reduce(zeros, group=self.mp_group)
        return int(zeros.item())

    def _copy_master_to_model_params(self) -> None:
        for model, master in zip(self.model_params, self.master_params):
            if model is not master:
                model.data.copy_(master.data)

    # --- checkpoints (issue 7) --------------------------------------------------------------------

    def state_dict(self) -> dict:
        state = {"optimizer": self.optimizer.state_dict()}
        state["fp32_master_params"] = [
            m.detach().clone() for p, m in zip(self.model_params, self.master_params) if p is not m
        ]
        if self.loss_scaler is not None:
            state["loss_scaler"] = self.loss_scaler.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        masters = [m for p, m in zip(self.model_params, self.master_params) if p is not m]
        saved = state.get("fp32_master_params", [])
        if len(saved) != len(masters):
            raise ValueError(
                f"checkpoint holds {len(saved)} fp32 master params, this optimizer has "
                f"{len(masters)}"
            )
        for m, s in zip(masters, saved):
            m.data.copy_(s)
        self._copy_master_to_model_params()
        if self.loss_scaler is not None and "loss_scaler" in state:
            self.loss_scaler.load_state_dict(state["loss_scaler"])

    # --- layout-independent state (megalite.core.optimizer.full_state), as ZeRO-1's ------------

    def name_params(self, model: torch.nn.Module) -> None:
        """Key ``full_state_dict`` by ``model``'s parameter names (``module.`` stripped)."""
        names = param_names(model)
        self.param_names = [names[p] for p in self.model_params]

    def full_state_dict(self, *, copy: bool = True) -> dict:
        """``{"params": {name: {"master", "exp_avg", "exp_avg_sq"}}, "step", "scaler"}`` (zeros
        before the first step). ``copy=False``: views of the live tensors, no copies (for saving:
        an fp32 master that is the parameter itself shares its storage, so ``torch.save`` writes
        those bytes once; save before the next step changes them). Needs ``name_params`` first."""
        names = self._names()
        params = {}
        for name, master in zip(names, self.master_params):
            state = adam_state_of(self.optimizer, master)
            entry = {"master": master.detach(), **{k: state[k].detach() for k in ADAM_KEYS}}
            params[name] = {k: v.float().clone() if copy else v for k, v in entry.items()}
        step = max((int(self.optimizer.state[m]["step"]) for m in self.master_params), default=0)
        scaler = None if self.loss_scaler is None else self.loss_scaler.state_dict()
        return {"params": params, "step": step, "scaler": scaler}

    @torch.no_grad()
    def load_full_state_dict(self, sd: dict) -> None:
        """Inverse of ``full_state_dict`` (from this optimizer or ZeRO-1's, any DP size)."""
        names = self._names()
        check_full_state(sd, {n: p.shape for n, p in zip(names, self.model_params)})
        for name, master in zip(names, self.master_params):
            entry, state = sd["params"][name], adam_state_of(self.optimizer, master)
            master.copy_(entry["master"])
            for key in ADAM_KEYS:
                state[key].copy_(entry[key])
            state["step"].fill_(float(sd["step"]))
        self._copy_master_to_model_params()
        if self.loss_scaler is not None and sd.get("scaler") is not None:
            self.loss_scaler.load_state_dict(sd["scaler"])

    def _names(self) -> list[str]:
        names = getattr(self, "param_names", None)
        if names is None:
            raise RuntimeError("call optimizer.name_params(model) before the full state dict")
        return names

"""The optimizer whose state is whole on every DP rank (no sharding; pairs with
``DistributedDataParallel``'s all-reduce).

Masters: an fp32 model parameter is its own master; a bf16 / fp16 one gets an fp32 copy. Master
grads are views of the fp32 grad buffer, or fp32 copies of 16-bit grads. The grad norm and the
inf/NaN flag are reduced over the model-parallel group: after the DP all-reduce every replica holds
the same grads, so DP needs no reduction.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from megalite.core.optimizer.full_state_format import ADAM_KEYS, adam_state_of, check_full_state
from megalite.core.optimizer.loss_scaler import LossScaler
from megalite.core.optimizer.mixed_precision import MixedPrecisionOptimizer, StepGrads

_COPIED_ATTRS = (
    "tensor_model_parallel",
    "partition_dim",
    "sequence_parallel",
    "partition_stride",
    "expert_parallel",
)


def _model_grad(param: nn.Parameter) -> torch.Tensor | None:
    """The grad buffer's ``main_grad`` when a data-parallel wrapper gave the parameter one (a
    parameter of an unwrapped model has no such attribute), else ``.grad``."""
    grad = getattr(param, "main_grad", None)
    return param.grad if grad is None else grad


class UnshardedOptimizer(MixedPrecisionOptimizer):
    """Wraps ``build_inner(master_param_groups) -> torch.optim.Optimizer``.

    ``param_groups``: torch-style groups of *model* parameters (``{"params": [...], **options}``).
    ``mp_group``: the model-parallel group (TP x PP) the norm and the inf/NaN flag reduce over;
    ``expert_mp_group`` (etp x ep x pp) / ``expert_tp_rank``: the same for expert parameters.
    """

    is_sharded = False  # the optimizer state is whole on every DP rank

    def __init__(
        self,
        param_groups: list[dict],
        build_inner: Callable[[list[dict]], torch.optim.Optimizer],
        *,
        model: nn.Module,
        clip_grad: float,
        mp_group,
        tp_rank: int,
        duplicates: Iterable[torch.Tensor] = (),
        loss_scaler: LossScaler | None = None,
        count_zeros: bool = False,
        expert_mp_group=None,
        expert_tp_rank: int = 0,
    ):
        super().__init__(
            param_groups,
            model=model,
            clip_grad=clip_grad,
            tp_rank=tp_rank,
            duplicates=duplicates,
            loss_scaler=loss_scaler,
            count_zeros=count_zeros,
            expert_tp_rank=expert_tp_rank,
        )
        self.mp_group = mp_group
        self.reduce_groups = (mp_group,)
        self.expert_reduce_groups = (expert_mp_group,)
        self.master_params: list[nn.Parameter] = []
        master_groups = []
        for group in param_groups:
            masters = [
                p if p.dtype == torch.float32 else self._make_master(p) for p in group["params"]
            ]
            self.master_params += masters
            master_groups.append({**group, "params": masters})
        self.optimizer = build_inner(master_groups)
        self._counted = [self.is_counted(p) for p in self.model_params]
        self._zeros_counted = [self.zeros_counted(p) for p in self.model_params]
        self._agree_on_experts()

    @staticmethod
    def _make_master(param: nn.Parameter) -> nn.Parameter:
        master = nn.Parameter(param.detach().clone().float())
        for name in _COPIED_ATTRS:
            if hasattr(param, name):
                setattr(master, name, getattr(param, name))
        return master

    def _prepare_grads(self) -> StepGrads:
        grads = []
        for model, master in zip(self.model_params, self.master_params):
            grad = _model_grad(model)
            if grad is None:
                grad = torch.zeros_like(master)
            master.grad = grad if grad.dtype == torch.float32 else grad.float()
            grads.append(master.grad)
        counted = [(g, p) for g, p, c in zip(grads, self.model_params, self._counted) if c]
        zeros = [(g, p) for g, p, c in zip(grads, self.model_params, self._zeros_counted) if c]
        counted_dense, counted_expert = self._split_expert(*zip(*counted) if counted else ([], []))
        zeros_dense, zeros_expert = self._split_expert(*zip(*zeros) if zeros else ([], []))
        return StepGrads(grads, counted_dense, zeros_dense, counted_expert, zeros_expert)

    def _update_model_params(self) -> None:
        for model, master in zip(self.model_params, self.master_params):
            if model is not master:
                model.data.copy_(master.data)

    # --- checkpoints ------------------------------------------------------------------------------

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
        self._update_model_params()
        if self.loss_scaler is not None and "loss_scaler" in state:
            self.loss_scaler.load_state_dict(state["loss_scaler"])

    def full_state_dict(self, *, copy: bool = True) -> dict:
        """``megalite.core.optimizer.full_state_format``'s dict (zeros before the first step).
        ``copy=False``: views of the live tensors, no copies (for saving: an fp32 master that is
        the parameter itself shares its storage, so ``torch.save`` writes those bytes once; save
        before the next step changes them)."""
        params = {}
        for name, master in zip(self.param_names, self.master_params):
            state = adam_state_of(self.optimizer, master)
            entry = {"master": master.detach(), **{k: state[k].detach() for k in ADAM_KEYS}}
            params[name] = {k: v.float().clone() if copy else v for k, v in entry.items()}
        step = max((int(self.optimizer.state[m]["step"]) for m in self.master_params), default=0)
        scaler = None if self.loss_scaler is None else self.loss_scaler.state_dict()
        return {"params": params, "step": step, "scaler": scaler}

    @torch.no_grad()
    def load_full_state_dict(self, sd: dict) -> None:
        """Inverse of ``full_state_dict`` (from this optimizer or ZeRO's, any DP size)."""
        check_full_state(sd, {n: p.shape for n, p in zip(self.param_names, self.model_params)})
        for name, master in zip(self.param_names, self.master_params):
            entry, state = sd["params"][name], adam_state_of(self.optimizer, master)
            master.copy_(entry["master"])
            for key in ADAM_KEYS:
                state[key].copy_(entry[key])
            state["step"].fill_(float(sd["step"]))
        self._update_model_params()
        if self.loss_scaler is not None and sd.get("scaler") is not None:
            self.loss_scaler.load_state_dict(sd["scaler"])

"""The full optimizer state: layout-independent, what both optimizers read and write (resharding).

    {"params": {param_name: {"master": fp32 tensor, "exp_avg": fp32, "exp_avg_sq": fp32}},
     "step": int,            # Adam steps taken (skipped fp16 steps not counted)
     "scaler": dict | None}  # the loss scaler's state_dict, None without a scaler

Each tensor has the shape of this *model-parallel* rank's parameter (full over DP, still sliced
over TP / PP: the checkpoint code reshards those along ``partition_dim``). ``param_name`` is the
name in the model's ``named_parameters()`` with the DP wrapper's ``module.`` prefix removed.
``UnshardedOptimizer`` and ``ShardedOptimizer`` (any rung) produce and accept the same dict, so a
state saved by one loads into the other, at any DP size.
"""

from __future__ import annotations

import torch
from torch import nn

ADAM_KEYS = ("exp_avg", "exp_avg_sq")


def param_names(model: nn.Module) -> dict[nn.Parameter, str]:
    """Each parameter of ``model`` -> its ``named_parameters()`` name without a ``module.`` prefix
    (tied parameters appear once, under their first name)."""
    return {p: n.removeprefix("module.") for n, p in model.named_parameters()}


def check_full_state(sd: dict, shapes: dict[str, torch.Size]) -> None:
    """One-line ValueError unless ``sd`` holds every name of ``shapes`` with that shape."""
    params = sd.get("params")
    if not isinstance(params, dict) or "step" not in sd:
        raise ValueError("a full optimizer state needs the keys 'params' and 'step'")
    for name, shape in shapes.items():
        entry = params.get(name)
        if entry is None:
            raise ValueError(
                f"the full optimizer state has no parameter {name!r} ({len(params)} parameters "
                "in it); was it saved from a different model or pipeline stage?"
            )
        for key in ("master", *ADAM_KEYS):
            got = tuple(entry[key].shape)
            if got != tuple(shape):
                raise ValueError(
                    f"full optimizer state: {name}.{key} has shape {list(got)}, this rank's "
                    f"parameter has {list(shape)}; reshard it over TP / PP first"
                )


def adam_state_of(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> dict:
    """``optimizer.state[param]`` with ``step``/``exp_avg``/``exp_avg_sq`` created (zeros) if the
    optimizer has not stepped yet, so they can be read or filled in place."""
    state = optimizer.state[param]
    if not state:
        group = next(g for g in optimizer.param_groups if any(p is param for p in g["params"]))
        on_device = group.get("fused") or group.get("capturable")
        state["step"] = torch.zeros(
            (), dtype=torch.float32, device=param.device if on_device else torch.device("cpu")
        )
        for key in ADAM_KEYS:
            state[key] = torch.zeros_like(param, memory_format=torch.preserve_format)
    return state

"""Megatron-LM's legacy ``torch`` checkpoint format, read and written.

    SAVE/latest_checkpointed_iteration.txt
    SAVE/iter_0000500/mp_rank_{tp:02d}[_{pp:03d}]/model_optim_rng.pt

Each file is ``torch.save`` of a dict: ``args`` (the run's argparse Namespace),
``checkpoint_version`` 3.0, ``iteration``, ``model`` (the stage's state dict, local layer
numbers, TE ``_extra_state`` entries), ``optimizer`` (torch Adam's state dict: state keyed by
the parameter's index in the param groups; Megatron's fp16/bf16 optimizer nests it under
``optimizer`` beside ``fp32_from_fp16_params``), ``opt_param_scheduler`` (``num_steps`` in
samples), ``rng_state`` (one dict per DP rank) and ``num_floating_point_operations_so_far``. The
names of the tensors are megalite's (DESIGN §5), so a shard converts to megalite's per-stage
form by dropping the extra states and keying the Adam state by name: the parameters in module
order, split into Megatron's
two default groups (with weight decay; without: biases and 1-D tensors).

A Megatron file holds pickled classes (the Namespace, Megatron's enums): it is read with an
unpickler that builds tensors, plain containers and the Namespace, and stands an inert
placeholder in for any other class, so that reading a checkpoint never imports or runs its code.
"""

from __future__ import annotations

import os
import pickle
import types
import zipfile

import torch

from megalite.checkpoint.files import MODEL_FILE, CheckpointError, shard_dir

CHECKPOINT_VERSION = 3.0
_EXTRA_STATE = "._extra_state"
_SAFE_BUILTINS = {"set", "frozenset", "slice", "complex", "range", "bytearray", "tuple", "list"}


class Opaque:
    """A pickled object of a class that is not read (a Megatron enum, a function): kept inert."""

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs

    def __setstate__(self, state):
        self.state = state

    def __repr__(self) -> str:
        return f"Opaque{self.args}"


def _opaque_class(module: str, name: str) -> type:
    return type(name, (Opaque,), {"__module__": f"opaque.{module}"})


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        allowed = (
            (module == "collections" and name == "OrderedDict")
            or (module == "argparse" and name == "Namespace")
            or (module == "builtins" and name in _SAFE_BUILTINS)
            or (module == "torch._utils" and name.startswith("_rebuild"))
            or (module == "torch._tensor" and name == "_rebuild_from_type_v2")
            or (module == "torch" and name in ("Size", "device", "Tensor"))
            # a dtype by name (torch.float32, ...); the name comes from the file, so may be anything
            or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
            or (module == "_codecs" and name == "encode")
            or (
                module.startswith("numpy")
                and name in ("_reconstruct", "ndarray", "dtype", "scalar")
            )
            or (module.startswith("numpy.dtypes") and name.endswith("DType"))
        )
        return super().find_class(module, name) if allowed else _opaque_class(module, name)


safe_pickle = types.SimpleNamespace(Unpickler=_Unpickler, load=pickle.load, __name__="safe_pickle")


def load_megatron_file(path: str) -> dict:
    """A Megatron ``model_optim_rng.pt`` (or ``common.pt``) as a dict, read safely (module doc)."""
    if not os.path.isfile(path):
        raise CheckpointError(f"Megatron checkpoint file {path} does not exist")
    try:
        return torch.load(path, map_location="cpu", weights_only=False, pickle_module=safe_pickle)
    except (RuntimeError, EOFError, OSError, ValueError, pickle.UnpicklingError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise CheckpointError(
            f"Megatron checkpoint file {path} cannot be read ({first[:160]}); it is truncated or "
            "corrupt: load another iteration (--ckpt-step N)"
        ) from None


def is_megatron_file(path: str) -> bool:
    """Whether ``path`` is a ``torch.save`` zip whose pickle holds Megatron's ``checkpoint_version``
    and not megalite's header (without unpickling it)."""
    try:
        with zipfile.ZipFile(path) as z:
            name = next(n for n in z.namelist() if n.endswith("data.pkl"))
            data = z.read(name)
    except (OSError, zipfile.BadZipFile, StopIteration):
        return False
    return b"checkpoint_version" in data and b"megalite_checkpoint" not in data


def find_megatron_shard(iter_dir: str) -> str | None:
    """The (TP 0, PP 0) ``model_optim_rng.pt`` of ``iter_dir`` when it is a Megatron file."""
    for pp_size in (1, 2):
        path = os.path.join(shard_dir(iter_dir, tp_rank=0, pp_rank=0, pp_size=pp_size), MODEL_FILE)
        if os.path.isfile(path):
            return path if is_megatron_file(path) else None
    return None


# --- optimizer state: Adam's indices <-> parameter names ------------------------------------------


def parameter_names(model_state: dict) -> list[str]:
    """The parameters of a Megatron stage state dict, in module order (its keys' order)."""
    return [
        k
        for k, v in model_state.items()
        if not k.endswith(_EXTRA_STATE) and isinstance(v, torch.Tensor)
    ]


def no_weight_decay(name: str, shape) -> bool:
    """Megatron's default rule: biases and 1-D parameters (norms) get no weight decay."""
    return name.endswith(".bias") or len(shape) == 1


def _is_no_wd_group(group: dict) -> bool:
    return float(group.get("wd_mult", 1.0)) == 0.0 or float(group.get("weight_decay", 1.0)) == 0.0


def adam_state_by_name(optimizer: dict, model_state: dict, *, where: str) -> dict:
    """Megatron's saved optimizer of one stage -> megalite's per-parameter form
    ``{"params": {name: {"master", "exp_avg", "exp_avg_sq"}}, "step", "scaler"}``."""
    inner = optimizer.get("optimizer", optimizer)  # Float16Optimizer nests torch's state dict
    fp32_from_fp16 = optimizer.get("fp32_from_fp16_params")
    names = parameter_names(model_state)
    groups = inner["param_groups"]
    by_group = [
        [n for n in names if no_weight_decay(n, model_state[n].shape) == _is_no_wd_group(g)]
        for g in groups
    ]
    params, step = {}, 0
    for gi, (group, group_names) in enumerate(zip(groups, by_group)):
        if len(group["params"]) != len(group_names):
            raise CheckpointError(
                f"Megatron checkpoint {where}: optimizer group {gi} has {len(group['params'])} "
                f"parameters where megalite expects {len(group_names)} (weight decay on/off by "
                "Megatron's default rule); a custom --no-weight-decay rule cannot be read: pass "
                "--no-load-optim"
            )
        for j, (index, name) in enumerate(zip(group["params"], group_names)):
            state = inner["state"].get(index, {})
            param = model_state[name]
            if fp32_from_fp16 is not None:
                master = fp32_from_fp16[gi][j]
            else:
                master = param
            zeros = torch.zeros(param.shape, dtype=torch.float32)
            exp_avg = state.get("exp_avg", zeros)
            if tuple(exp_avg.shape) != tuple(param.shape):
                raise CheckpointError(
                    f"Megatron checkpoint {where}: the Adam state of {name} has shape "
                    f"{tuple(exp_avg.shape)}, the parameter {tuple(param.shape)}; pass "
                    "--no-load-optim"
                )
            params[name] = {
                "master": master.float(),
                "exp_avg": exp_avg.float(),
                "exp_avg_sq": state.get("exp_avg_sq", zeros).float(),
            }
            if "step" in state:
                step = max(step, int(state["step"]))
    scaler = optimizer.get("grad_scaler")
    if isinstance(scaler, dict) and "scale" in scaler:
        scaler = {k: v for k, v in scaler.items() if not isinstance(v, Opaque)}
    else:
        scaler = None
    return {"params": params, "step": step, "scaler": scaler}


def adam_state_dict(full: dict, names: list[str], *, lr: float, weight_decay: float) -> dict:
    """megalite's per-parameter optimizer form -> the torch Adam state dict Megatron's FP32
    optimizer saves (indices in Megatron's group order: with weight decay, then without)."""
    shapes = {n: full["params"][n]["master"].shape for n in names}
    decayed = [n for n in names if not no_weight_decay(n, shapes[n])]
    plain = [n for n in names if no_weight_decay(n, shapes[n])]
    state, groups, index = {}, [], 0
    for group_names, wd_mult in ((decayed, 1.0), (plain, 0.0)):
        if not group_names:
            continue
        ids = []
        for n in group_names:
            p = full["params"][n]
            state[index] = {
                "step": torch.tensor(float(full["step"])),
                "exp_avg": p["exp_avg"],
                "exp_avg_sq": p["exp_avg_sq"],
            }
            ids.append(index)
            index += 1
        group = param_group(lr=lr, weight_decay=weight_decay, wd_mult=wd_mult)
        groups.append({**group, "params": ids})
    return {"state": state, "param_groups": groups}


def param_group(*, lr: float, weight_decay: float, wd_mult: float) -> dict:
    """The settings of one of Megatron's two default param groups (``wd_mult`` 1: with weight
    decay; 0: biases and norms), as its optimizer saves them."""
    return {
        "wd_mult": wd_mult,
        "lr_mult": 1.0,
        "is_expert_parallel": False,
        "is_decoupled_lr": False,
        "default_config": True,
        "lr": lr,
        "weight_decay": weight_decay * wd_mult,
    }

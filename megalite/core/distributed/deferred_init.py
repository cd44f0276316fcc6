"""A model bigger than the host: built on the meta device, its values written unit by unit.

    module = GPTModel(config, ps, device=torch.device("meta"))   # shapes only, nothing drawn
    release_params(module, torch.device("cpu"))   # meta params -> params with 0-byte storage
    model = Zero3DataParallel(module, ..., unit_init=lambda unit: module.build_twin(unit, ps))

``release_params`` replaces each meta parameter by a parameter of the same shape, dtype and
attributes on ``device`` whose storage holds no bytes (a tied parameter stays one object), so the
wrappers, hooks and optimizers that keep parameter objects see their final ones. ZeRO-3 then fills
one unit at a time (``UnitValues``): ``unit_init(unit)`` builds a *twin* of the unit on the host,
a normal build of that unit alone with the same keyed initialisation (the values do not depend on
what else is built, ``core.tensor_parallel.init``), the unit's flat bucket is copied from the
twin's parameters by name, this rank's part is written to its shard (the device, the host or a
file) and the bucket is released before the next unit. The host holds one twin and one bucket at
a time, whatever the model's size. Buffers still on the meta device (the MoE router's) are taken
from the twin too.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

UnitInit = Callable[[nn.Module], nn.Module]


def release_params(module: nn.Module, device: torch.device) -> int:
    """Replace every meta parameter of ``module`` by one with 0-byte storage on ``device`` (same
    shape, dtype, ``requires_grad`` and attributes); returns how many were replaced."""
    new: dict[nn.Parameter, nn.Parameter] = {}
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if p not in new:
                t = torch.empty(p.shape, dtype=p.dtype, device=device)
                t.untyped_storage().resize_(0)  # shape and strides without the bytes
                q = nn.Parameter(t, requires_grad=p.requires_grad)
                q.__dict__.update(p.__dict__)  # tensor_model_parallel, partition_dim, ...
                new[p] = q
            setattr(sub, name, new[p])
    return len(new)


def is_released(p: torch.Tensor) -> bool:
    """A parameter ``release_params`` made (or ZeRO-3 released): elements without bytes."""
    return p.numel() > 0 and p.untyped_storage().nbytes() == 0


class UnitValues:
    """The initial values of the parameters of ``units`` from ``unit_init``'s twins, one unit at
    a time (the last twin is kept: a unit's parameters may sit in several buckets in a row)."""

    def __init__(self, units: list[nn.Module], unit_init: UnitInit):
        self.units, self.unit_init = units, unit_init
        self._index, self._twin = -1, {}
        self._names: dict[nn.Parameter, str] = {}

    def value(self, unit: int, param: nn.Parameter) -> torch.Tensor:
        """``param``'s initial value: the twin of ``units[unit]``'s parameter of the same name."""
        if unit != self._index:
            self._index, self._twin = -1, {}  # drop the previous twin before building the next
            twin = self.unit_init(self.units[unit])
            self._twin = dict(twin.named_parameters())
            self._names = {p: n for n, p in self.units[unit].named_parameters()}
            _copy_meta_buffers(self.units[unit], twin)
            self._index = unit
        name = self._names[param]
        value = self._twin.get(name)
        if value is None or value.shape != param.shape:
            raise ValueError(
                f"unit_init's twin of unit {unit} has no parameter {name} of shape "
                f"{tuple(param.shape)}"
            )
        return value.detach()

    def drop(self) -> None:
        self._index, self._twin, self._names = -1, {}, {}


def _copy_meta_buffers(unit: nn.Module, twin: nn.Module) -> None:
    """The twin's buffers in place of ``unit``'s meta ones (on the device of its parameters)."""
    twin_buffers = dict(twin.named_buffers())
    device = next((p.device for p in unit.parameters()), torch.device("cpu"))
    for name, buf in list(unit.named_buffers()):
        if buf is not None and buf.is_meta:
            owner_name, _, leaf = name.rpartition(".")
            owner = unit.get_submodule(owner_name) if owner_name else unit
            owner._buffers[leaf] = twin_buffers[name].to(device)

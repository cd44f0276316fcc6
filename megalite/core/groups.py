"""Process-group helpers every parallel axis shares: the size and rank of a group, the tensor
collectives under the names this torch has, and a sum of many tensors in one collective.

``None`` means a group of one (no communication), as everywhere in megalite: an oracle model built
with ``ParallelState.single()`` inside a multi-rank test passes ``None`` for each of its groups.
Every collective megalite issues goes through an explicit group; none of these falls back to the
world group. Each is recorded by the op recorder (``op_record.py``) when it is on: ``what`` says
what the tensor is for.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megalite.core.op_record import RECORDER


def group_size(group) -> int:
    if group is None or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group) -> int:
    if group is None or not dist.is_initialized():
        return 0
    return dist.get_rank(group)


# The tensor collectives are looked up by name at each call: torch 2.13 renames them
# (``*_single``) and deprecates the older names, which are all older torch versions have.


def _recorded(
    name: str, fn, x: torch.Tensor, group, what: str | None, async_op: bool, *args, **kwargs
):
    """``fn(*args, group=group, async_op=async_op, **kwargs)``, recorded when the recorder is on
    (an asynchronous op is recorded as posted; the caller's wait is not seen)."""
    if not RECORDER.enabled:
        return fn(*args, group=group, async_op=async_op, **kwargs)
    record = RECORDER.post if async_op else RECORDER.begin
    rec = record(name, group=group, what=what, shape=x.shape)
    out = fn(*args, group=group, async_op=async_op, **kwargs)
    if not async_op:
        RECORDER.end(rec)
    return out


def _host_on_nccl(x: torch.Tensor, group) -> bool:
    """``x`` lives on the host but ``group`` is nccl's, which takes only CUDA tensors (offloaded
    grads and their norms)."""
    return (
        x.device.type == "cpu"
        and group is not None
        and torch.cuda.is_initialized()  # a CPU-only run never asks for the backend
        and dist.get_backend(group) == "nccl"
    )


def all_reduce_tensor(
    x: torch.Tensor, group, *, op=dist.ReduceOp.SUM, what: str | None = None
) -> None:
    """``dist.all_reduce`` (``op``, default sum) of ``x`` over ``group``, in place; a host tensor
    on an nccl group goes through the current CUDA device."""
    if _host_on_nccl(x, group):
        on_device = x.to(torch.device("cuda", torch.cuda.current_device()))
        _recorded("all_reduce", dist.all_reduce, on_device, group, what, False, on_device, op=op)
        x.copy_(on_device)
        return
    _recorded("all_reduce", dist.all_reduce, x, group, what, False, x, op=op)


def broadcast_tensor(x: torch.Tensor, src: int, group, *, what: str | None = None) -> None:
    """``dist.broadcast`` of global rank ``src``'s ``x`` over ``group``, in place."""
    _recorded("broadcast", dist.broadcast, x, group, what, False, x, src=src)


def all_to_all_tensor(out, x, out_splits, in_splits, group, *, what: str | None = None) -> None:
    """``dist.all_to_all_single``: rank j's ``in_splits[i]`` rows go to rank i's ``out``."""
    _recorded(
        "all_to_all", dist.all_to_all_single, x, group, what, False, out, x, out_splits, in_splits
    )


def all_gather_tensor(
    out: torch.Tensor, x: torch.Tensor, group, *, async_op: bool = False, what: str | None = None
):
    """``dist.all_gather_single`` where torch has it, else ``dist.all_gather_into_tensor``:
    concatenate every rank's ``x`` along dim 0 into ``out``. Returns the work with ``async_op``."""
    fn = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    return _recorded("all_gather", fn, x, group, what, async_op, out, x)


def reduce_scatter_tensor(
    out: torch.Tensor, x: torch.Tensor, group, *, async_op: bool = False, what: str | None = None
):
    """``dist.reduce_scatter_single`` where torch has it, else ``dist.reduce_scatter_tensor``: sum
    ``x`` over the group, keep this rank's chunk of dim 0. Returns the work with ``async_op``."""
    fn = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
    return _recorded("reduce_scatter", fn, x, group, what, async_op, out, x)


def all_reduce_flat(tensors: list[torch.Tensor], group) -> None:
    """Sum ``tensors`` (same dtype) over ``group`` in one collective, in place."""
    if group_size(group) == 1 or not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    all_reduce_tensor(flat, group, what=f"{len(tensors)} tensors")
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()

"""ZeRO-3 (``optim_grads_params``): parameters sharded over the data-parallel group too, gathered
one *unit* at a time (a transformer layer, the embedding, the final norm, the output layer).

    model = Zero3DataParallel(module, dp_group=ps.group("dp", "cp"), units=[...], ...)
    model.zero_grad_buffer()
    forward_backward(...)           # each unit gathered before its forward and its backward
    model.finish_grad_sync()        # as ZeRO-2 (grads reduce-scattered per unit bucket)
    optimizer.step()                # ShardedOptimizer: updates the param shards in place

Built on ZeRO-2 (``Zero2DataParallel``): every unit is one bucket of the grad buffer (explicit
``GradBufferLayout`` groups), so a unit's grads are reduce-scattered as soon as its backward is
done. The parameters get the same layout::

    param_shards[key]   [numel/d]         param dtype; this rank's elements, always resident
    full[(b, k)]        [bucket k numel]  param dtype; every param of unit k views it (param.data);
                                          its storage is resized to 0 bytes when released

Gather / release. A forward pre-hook on each unit all-gathers its bucket (waiting for a prefetch
in flight) and starts the all-gather of the next unit (``prefetch``); a forward post-hook releases
the bucket and hooks the unit's outputs, whose grad arriving (just before the unit's backward)
gathers the bucket again and prefetches the previous unit. After backward, a bucket is released
once every parameter in it has its grad (the post-accumulate-grad hooks: no later backward op
reads it). Storage is resized in place, so tensors autograd saved in forward (the parameters
themselves, or views of them) see the re-gathered values. Forward hooks that run inside backward
(activation recomputation) keep the unit gathered. ``unit_extras`` names parameters a unit reads
but does not own (the tied word embedding read by the output layer when PP = 1): they are gathered
and released with it. Parameters in no unit form a persistent bucket that is never released.

Peak parameter bytes during forward: the shards (``P/d``) + the unit being computed + the one
prefetched. Per micro-batch each unit is gathered twice (forward and backward) and its grads
reduce-scattered once: ``3 (d-1)/d`` of the param-dtype bytes moved per rank, against ``2 (d-1)/d``
for DDP's all-reduce (1.5x); with ``m`` micro-batches (pipeline 1F1B or accumulation) it is ``m``
times that, as the model is re-gathered per micro-batch.

Outside forward/backward the params are released: read or write them inside
``gathered_params()`` (state dicts, checkpoint save/load, tests), which gathers every unit and on
exit copies this rank's part back into the shards.

Construction streams: each unit's bucket is filled, its part written to the shard's home and the
bucket released before the next, so a module whose parameters were built without bytes
(``deferred_init.release_params``, from the meta device) is filled by ``unit_init``'s twins one
unit at a time and never exists whole on the host.

Grad offload (``grad_offload``): the reduced grad shards on the host, or with ``grad_files`` (the
param shards in files) in files beside them (``grad_files.GradFiles``), which the optimizer reads
back in chunks.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from megalite.core.distributed.data_parallel import BucketKey
from megalite.core.distributed.deferred_init import UnitInit, UnitValues, is_released
from megalite.core.distributed.grad_buffer import Bucket, GradBuffer
from megalite.core.distributed.grad_files import GradFiles
from megalite.core.distributed.param_offload import ParamFile, ParamOffloadSpec, ParamStore
from megalite.core.distributed.shard_collectives import all_gather_shard
from megalite.core.distributed.zero2_data_parallel import Zero2DataParallel
from megalite.core.groups import group_size


def default_units(module: nn.Module) -> list[nn.Module]:
    """The direct children of ``module`` that hold trainable parameters (the children of a
    ``ModuleList`` / ``ModuleDict``, which has no forward, in its place)."""
    out = []
    for m in module.children():
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)):
            out += default_units(m)
        elif any(p.requires_grad for p in m.parameters()):
            out.append(m)
    return out


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class Zero3DataParallel(Zero2DataParallel):
    """ZeRO-3 (module docstring). Arguments as ``Zero1DataParallel`` (``overlap_param_gather`` is
    refused: ZeRO-3 always gathers per unit before use), plus ``units`` (forward order; default
    ``default_units``), ``unit_extras`` ({unit: params it reads but does not own}),
    ``prefetch``, ``param_offload`` (the param shards on the host or in files),
    ``grad_offload`` (the reduced grad shards on the host; with ``grad_files`` in files beside the
    param files) and ``unit_init`` (each unit's values from a twin: module docstring)."""

    zero_stage = 3  # the rung of the ladder (memory report)
    keeps_whole_params = False  # released when ``gathered_params`` is left

    def __init__(
        self,
        module: nn.Module,
        *,
        units: Iterable[nn.Module] | None = None,
        unit_extras: dict[nn.Module, list[nn.Parameter]] | None = None,
        prefetch: bool = True,
        overlap_param_gather: bool = False,
        param_offload: ParamOffloadSpec | None = None,
        grad_offload: bool = False,
        grad_files: bool = False,
        unit_init: UnitInit | None = None,
        **kwargs,
    ):
        if overlap_param_gather:
            raise ValueError(
                "overlap_param_gather does not apply to ZeRO-3 (optim_grads_params): it gathers "
                "each unit before its forward and prefetches the next; drop overlap_param_gather"
            )
        self.units = list(default_units(module) if units is None else units)
        self.prefetch = prefetch
        trainable = [p for p in module.parameters() if p.requires_grad]
        self._unit_of: dict[nn.Parameter, int] = {}
        for i, unit in enumerate(self.units):
            for p in unit.parameters():
                if p.requires_grad:
                    self._unit_of.setdefault(p, i)
        self._rest_unit = len(self.units)  # parameters in no unit: one persistent bucket
        for p in trainable:
            self._unit_of.setdefault(p, self._rest_unit)
        self.bucket_groups = self._groups_by_unit
        self.param_offload, self.grad_offload = param_offload, grad_offload
        self.grad_home = "file" if grad_files else "host" if grad_offload else "device"
        self._unit_values = None if unit_init is None else UnitValues(self.units, unit_init)
        super().__init__(module, **kwargs)
        self.host_grads = [b.data for b in self.grad_buffers if b.home == "host"]
        self.grad_files: GradFiles | None = None  # the grad shards in files (module docstring)
        if grad_files:
            sp_over_tp = bool(self._sp_params) and group_size(self.tp_group) > 1
            self.grad_files = GradFiles(
                self.param_store, self.grad_buffers, dp_size=self.dp_size, sp_over_tp=sp_over_tp
            )
        self._unit_keys: list[list[BucketKey]] = [[] for _ in range(len(self.units) + 1)]
        for key, bucket in self._buckets.items():
            self._unit_keys[self._unit_of[bucket.params[0]]].append(key)
        self._persistent = set(self._unit_keys[self._rest_unit])
        for unit, extra in (unit_extras or {}).items():
            i = self.units.index(unit)
            self._unit_keys[i] += sorted(
                {self._bucket_key[p] for p in extra} - {*self._unit_keys[i]}
            )
        self._resident = {k for k, t in self._full.items() if t.untyped_storage().nbytes()}
        self._gather_works: dict[BucketKey, list] = {}
        self._reading: dict[BucketKey, object] = {}  # file reads in flight (storage allocated)
        self._param_peak, self._gathered_depth = 0, 0
        for key in list(self._full):
            self._release(key)
        for i, unit in enumerate(self.units):
            unit.register_forward_pre_hook(self._make_pre_forward(i))
            unit.register_forward_hook(self._make_post_forward(i))

    def _groups_by_unit(self, params: list[nn.Parameter]) -> list[list[int]]:
        """Bucket groups of one buffer: its params by unit, in unit (forward) order."""
        by_unit: dict[int, list[int]] = {}
        for i, p in enumerate(params):
            by_unit.setdefault(self._unit_of[p], []).append(i)
        return [by_unit[u] for u in sorted(by_unit)]

    # --- storage ----------------------------------------------------------------------------------

    def _init_param_storage(self) -> None:
        """Per buffer: the flat shard at ``param_store``'s home; per bucket, one at a time: a full
        tensor the params view, filled from the params (or ``unit_init``'s twins), this rank's
        part written to the shard, then released (the persistent bucket stays)."""
        # the params' device: a grad shard's ``data`` may sit on the host (grad offload)
        device = next(iter(self.buffers_by_key.values())).device
        rank = dist.get_rank() if dist.is_initialized() else 0
        prefix = f"rank{rank}_zero3_{os.getpid()}_{id(self):x}"
        self.param_store = ParamStore(self.param_offload, device=device, prefix=prefix)
        self.param_shards = {}
        self._full: dict[BucketKey, torch.Tensor] = {}
        for b, (key, buffer) in enumerate(self.buffers_by_key.items()):
            shard = self.param_store.create(f"b{b}", buffer.shard_numel, key[0])
            for bucket in buffer.buckets:
                numel = buffer.layout.buckets[bucket.index].numel
                full = torch.zeros(numel, dtype=key[0], device=device)
                with torch.no_grad():
                    for p in bucket.params:
                        lo, hi, _ = buffer.param_ranges[p]
                        view = full[lo - bucket.offset : hi - bucket.offset]
                        view.copy_(self._initial_value(p).reshape(-1))
                        p.data = view.view(p.shape)
                lo, hi, s = buffer.segments[bucket.index]
                self.param_store.write(shard, s, full[lo - bucket.offset : hi - bucket.offset])
                self._full[b, bucket.index] = full
                if self._unit_of[bucket.params[0]] != self._rest_unit:
                    full.untyped_storage().resize_(0)  # released: gathered at its first use
            self.param_shards[key] = shard
        if self._unit_values is not None:
            self._unit_values.drop()

    def _initial_value(self, p: nn.Parameter) -> torch.Tensor:
        """``p``'s value: its own, or (``unit_init``) its unit's twin's."""
        if self._unit_values is None and not is_released(p):
            return p.detach()
        if self._unit_values is None or self._unit_of[p] == self._rest_unit:
            raise ValueError(f"parameter {self._names[p]} has no bytes and no unit_init twin")
        return self._unit_values.value(self._unit_of[p], p)

    def param_shard_of(self, buffer: GradBuffer) -> torch.Tensor | ParamFile:
        key = next(k for k, v in self.buffers_by_key.items() if v is buffer)
        return self.param_shards[key]

    def buffer_pairs(self) -> list[tuple[None, GradBuffer]]:
        return [(None, g) for g in self.grad_buffers]

    def _own_part(self, key: BucketKey) -> tuple[torch.Tensor, torch.Tensor | ParamFile, int]:
        """(this rank's part of ``full[key]``, the param shard holding it, its offset there)."""
        buffer = self.grad_buffers[key[0]]
        bucket = self._buckets[key]
        lo, hi, s = buffer.segments[bucket.index]
        shard = self.param_shards[list(self.buffers_by_key)[key[0]]]
        return self._full[key][lo - bucket.offset : hi - bucket.offset], shard, s

    def _allocate(self, key: BucketKey) -> None:
        full = self._full[key]
        full.untyped_storage().resize_(full.numel() * full.element_size())

    def _start_reads(self, keys: Iterable[BucketKey]) -> None:
        """Files: this rank's part of each unit bucket read on the reader thread (the prefetch;
        the all-gather starts at the unit's use)."""
        for key in keys:
            if key in self._resident or key in self._reading:
                continue
            self._allocate(key)
            mine, shard, s = self._own_part(key)
            self._reading[key] = self.param_store.prefetch(shard, s, mine)
        self._param_peak = max(self._param_peak, self.gathered_bytes())

    def _gather(self, keys: Iterable[BucketKey], *, async_op: bool = False) -> None:
        for key in keys:
            if key in self._resident:
                continue
            if key in self._reading:
                self._reading.pop(key).result()
            else:
                self._allocate(key)
                mine, shard, s = self._own_part(key)
                self.param_store.read_into(shard, s, mine)
            full = self._full[key]
            group = self._buckets[key].dp_group
            self._gather_works[key] = all_gather_shard(
                full, group, async_op=async_op, what=self._gather_what(key)
            )
            self._resident.add(key)
        self._param_peak = max(self._param_peak, self.gathered_bytes())

    def _gather_what(self, key: BucketKey) -> str:
        """What the op recorder calls bucket ``key``'s gather: its unit (the module the hooks
        gather for; the last is the parameters outside every unit) and bucket."""
        unit = self._unit_of[self._buckets[key].params[0]]
        name = "the rest" if unit == self._rest_unit else f"unit {unit}"
        return f"params of {name} (bucket {key[0]}.{key[1]})"

    def _wait(self, keys: Iterable[BucketKey]) -> None:
        for key in keys:
            for work in self._gather_works.pop(key, ()):
                work.wait()

    def _release(self, key: BucketKey) -> None:
        if key in self._reading:  # a prefetch not used: drop it
            self._reading.pop(key).result()
            self._full[key].untyped_storage().resize_(0)
        if key in self._persistent or key not in self._resident:
            return
        self._wait([key])
        self._full[key].untyped_storage().resize_(0)
        self._resident.discard(key)

    def gathered_bytes(self) -> int:
        """Bytes of whole unit buckets resident now (persistent bucket included, and those a file
        read is filling)."""
        keys = self._resident | set(self._reading)
        return sum(self._full[k].numel() * self._full[k].element_size() for k in keys)

    @property
    def param_peak_bytes(self) -> int:
        """The most whole-unit bytes resident at once since ``reset_peak``."""
        return self._param_peak

    def reset_peak(self) -> None:
        self._param_peak = self.gathered_bytes()
        self._staged_peak = self.staged_bytes()

    # --- hooks ------------------------------------------------------------------------------------

    def _make_pre_forward(self, i: int):
        def pre_forward(module, args):
            keys = self._unit_keys[i]
            self._gather(keys)
            self._wait(keys)
            if self.prefetch and not _in_backward() and i + 1 < len(self.units):
                self._prefetch(self._unit_keys[i + 1])

        return pre_forward

    def _prefetch(self, keys: list[BucketKey]) -> None:
        """The next unit: its file reads (param shards in files), else its all-gather."""
        if self.param_store.place == "disk":
            self._start_reads(keys)
        else:
            self._gather(keys, async_op=True)

    def _make_post_forward(self, i: int):
        def post_forward(module, args, output):
            if _in_backward():  # recomputation inside backward: the backward needs the unit next
                return
            if torch.is_grad_enabled():
                for t in _tensors(output):
                    if t.requires_grad:
                        t.register_hook(self._make_pre_backward(i))
            for key in self._unit_keys[i]:
                self._release(key)

        return post_forward

    def _make_pre_backward(self, i: int):
        def pre_backward(grad):
            keys = self._unit_keys[i]
            self._gather(keys)
            self._wait(keys)
            if self.prefetch and i > 0:
                self._prefetch(self._unit_keys[i - 1])

        return pre_backward

    def _bucket_complete(self, key: BucketKey) -> None:
        super()._bucket_complete(key)
        self._release(key)  # every param of the bucket has its grad: no backward op reads it

    def _add_shard(self, bucket: Bucket) -> None:
        """As ZeRO-2; with ``grad_offload`` the reduced shard is copied to its host home, with
        ``grad_files`` written (the step's first part) or added to its file."""
        buffer = self.buffer_of(bucket.params[0])
        staged, shard = buffer.shard_of_bucket(bucket)
        if self.grad_files is not None:
            key = self._bucket_key[bucket.params[0]]
            self.grad_files.put(key[0], key[1], staged)
        else:
            shard.add_(staged.to(shard.device))
        buffer.unstage(bucket)

    def zero_grad_buffer(self) -> None:
        super().zero_grad_buffer()
        if self.grad_files is not None:
            self.grad_files.new_step()

    # --- the step and whole-parameter access ------------------------------------------------------

    def finish_grad_sync(self) -> None:
        super().finish_grad_sync()
        if self.grad_files is not None:
            self.grad_files.fill_unwritten()
        for key in [*self._resident, *self._reading]:
            self._release(key)

    def gather_params(self) -> None:
        """After the update: re-gather the buckets resident now (the persistent one) from the
        updated shards; the others are gathered at their next use."""
        resident = list(self._resident)
        self._resident.difference_update(resident)
        self._gather(resident)
        self._wait(resident)

    def finish_param_sync(self) -> None:
        """No all-gather in flight, and no file read (the optimizer may write the shards next)."""
        self._wait(list(self._gather_works))
        for key in list(self._reading):
            self._release(key)

    @contextlib.contextmanager
    def gathered_params(self) -> Iterator[None]:
        """Every unit gathered inside; on exit this rank's part of each is written back into the
        shards (so loads into the params persist) and the units are released. Nests (the
        outermost gathers and writes back)."""
        self._gathered_depth += 1
        if self._gathered_depth > 1:  # nested: the outermost gathers and writes back
            try:
                yield
            finally:
                self._gathered_depth -= 1
            return
        keys = list(self._full)
        self._gather(keys)
        self._wait(keys)
        try:
            yield
        finally:
            self._gathered_depth -= 1
            with torch.no_grad():
                for key in keys:
                    mine, shard, s = self._own_part(key)
                    self.param_store.write(shard, s, mine)
            for key in keys:
                self._release(key)

    def remove_offload_files(self) -> None:
        """The end of a run: delete the param and grad files this wrapper created."""
        self.param_store.remove_files()

    def state_dict(self, *args, **kwargs):
        """The module's state dict, gathered (copies: the params are released on return)."""
        with self.gathered_params():
            return {k: v.clone() for k, v in self.module.state_dict(*args, **kwargs).items()}

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        with self.gathered_params():
            return self.module.load_state_dict(state_dict, strict=strict, assign=assign)


def _tensors(output) -> list[torch.Tensor]:
    if torch.is_tensor(output):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for o in output for t in _tensors(o)]
    return []

"""ZeRO-1 data parallelism (``optim``), the base of the ZeRO-2 and ZeRO-3 wrappers: grads are
reduce-scattered into per-rank shards, parameters live in contiguous buffers and are all-gathered
from their owners' shards after the update.

    model = Zero1DataParallel(module, dp_group=ps.group("dp", "cp"), tp_group=ps.tp_group, ...)
    model.zero_grad_buffer()
    forward_backward(...)           # all but the last micro-batch inside model.no_sync()
    model.finish_grad_sync()        # each DP rank: its shard of every bucket holds the DP mean
    optimizer.step()                # ShardedOptimizer: update own shard, then gather_params()

The parameters are not sharded (ZeRO-1: every rank holds the whole model and a whole grad buffer);
what is sharded is who *owns* which elements: the reduced grads and the optimizer state.

Layout. As in ``DistributedDataParallel``, each param dtype has one ``GradBuffer`` cut into buckets;
here every bucket is padded to a multiple of ``dp_size`` and split into ``dp_size`` equal,
contiguous shards (``GradBufferLayout.shard_range``). The parameters themselves are moved into a
*parameter buffer* of the param dtype with exactly the grad buffer's layout (``param.data`` becomes
a view of it), so the updated shards are gathered with one collective per bucket and no copies::

    grad_buffers[i].data    [numel]  grad dtype (fp32 with accumulate_allreduce_grads_in_fp32)
    param_buffers[i]        [numel]  param dtype; param.data = param_buffers[i][lo:hi].view(shape)

Accumulation: as in the base class, except that ``zero_grad_buffer`` does not clear the buffer:
a parameter's first grad of a step is copied into ``main_grad``, later ones are added, and
``finish_grad_sync`` zeroes the ``main_grad`` of parameters that received none (padding is never
written, so it stays zero).

``finish_grad_sync``, in this order:
1. sum over the embedding group the grads of ``shared_params`` (whole tensors: the shared
   embedding sits at different offsets on the first and the last stage, so this sum must come
   before the grads are sharded);
2. for each bucket: reduce-scatter (sum) over the DP group, then divide this rank's shard by
   ``dp_size`` (fp16 buffers: the whole bucket before the sum, for range); ``data[shard]`` then
   holds the DP mean, the rest of the bucket is undefined;
3. sum over the TP group the shard's part of the ``sequence_parallel`` params' grads (TP peers
   have the same layout and DP rank, hence the same shard; checked at construction).
Sums are linear, so the result equals the all-reduce path's up to rounding.

Overlap (both off by default):
- ``overlap_grad_reduce``: a bucket's reduce-scatter starts from the grad hook once every
  parameter in it has received its grad from the last micro-batch (outside ``no_sync``); buckets
  holding ``shared_params`` wait for step 1. ``finish_grad_sync`` starts the rest and waits for all.
- ``overlap_param_gather``: ``gather_params`` only starts the all-gathers (in forward order); a
  forward pre-hook on each module that owns parameters waits for their buckets, so the gather of
  later layers overlaps the forward of earlier ones. Contract: a parameter is read only in the
  forward of a module that owns it or after it (true of GPTModel, including tied embeddings);
  ``state_dict()`` and ``finish_grad_sync`` wait for everything still in flight.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from megalite.core.distributed.data_parallel import BucketKey, BufferKey, DistributedDataParallel
from megalite.core.distributed.grad_buffer import Bucket, GradBuffer
from megalite.core.distributed.shard_collectives import (
    PendingReduceScatter,
    ScratchBuffers,
    all_gather_shard,
    reduce_scatter_shard,
    start_reduce_scatter_shard,
)
from megalite.core.groups import all_reduce_flat, group_rank, group_size


class Zero1DataParallel(DistributedDataParallel):
    """``DistributedDataParallel`` whose grad sync is a reduce-scatter into per-rank shards (the
    ZeRO rungs); pair it with ``megalite.core.optimizer.ShardedOptimizer``. Arguments as the
    base class (without ``pad_multiple``: always the buffer's DP group size; expert buffers are
    sharded over ``expert_dp_group``), plus ``overlap_param_gather``."""

    zero_stage = 1  # the rung of the ladder (memory report)

    def __init__(
        self,
        module: nn.Module,
        *,
        dp_group,
        tp_group=None,
        embedding_group=None,
        shared_params: Iterable[nn.Parameter] = (),
        accumulate_allreduce_grads_in_fp32: bool = False,
        bucket_size: int | None = None,
        overlap_grad_reduce: bool = False,
        overlap_param_gather: bool = False,
        expert_dp_group=None,
    ):
        super().__init__(
            module,
            dp_group=dp_group,
            tp_group=tp_group,
            embedding_group=embedding_group,
            shared_params=shared_params,
            accumulate_allreduce_grads_in_fp32=accumulate_allreduce_grads_in_fp32,
            bucket_size=bucket_size,
            overlap_grad_reduce=overlap_grad_reduce,
            expert_dp_group=expert_dp_group,
        )
        self.dp_rank = group_rank(dp_group)
        self.overlap_param_gather = overlap_param_gather
        self._scratch = ScratchBuffers()
        self.param_buffers: dict[BufferKey, torch.Tensor] = {}
        self._init_param_storage()
        self._deferred = {self._bucket_key[p] for p in self.shared_params}
        self._unwritten: set[nn.Parameter] = set(self._bucket_key)  # main_grad not yet this step
        # overlap_param_gather: works in flight per bucket, and the pre-hooks that wait for them
        self._gathering: dict[BucketKey, list] = {}
        if overlap_param_gather:
            for sub in module.modules():
                owned = [p for p in sub.parameters(recurse=False) if p in self._bucket_key]
                keys = sorted({self._bucket_key[p] for p in owned})
                if keys:
                    sub.register_forward_pre_hook(self._make_wait_hook(keys))
            module.register_state_dict_pre_hook(lambda *_: self.finish_param_sync())
        self._check_tp_layout()

    def _init_param_storage(self) -> None:
        """ZeRO-1/2: every parameter becomes a view of a whole param buffer per buffer key."""
        for key, buffer in self.buffers_by_key.items():
            data = torch.zeros(buffer.numel, dtype=key[0], device=buffer.device)
            for param, (lo, hi, _) in buffer.param_ranges.items():
                data[lo:hi].copy_(param.detach().reshape(-1))
                param.data = data[lo:hi].view(param.shape)
            self.param_buffers[key] = data

    def param_shard_of(self, buffer: GradBuffer) -> torch.Tensor | None:
        """ZeRO-3's flat param shard of ``buffer`` (None here: the param buffer is whole)."""
        del buffer
        return None

    def _check_tp_layout(self) -> None:
        """Step 3 sums shard slices over TP: every TP peer must have this rank's layout."""
        if group_size(self.tp_group) == 1 or not self._sp_params:
            return
        layout = [b.numel for buf in self.grad_buffers for b in buf.layout.buckets]
        layout += [x for p in self._sp_params for x in self.buffer_of(p).param_ranges[p]]
        signature = torch.tensor([hash(tuple(layout)) % (1 << 62)], dtype=torch.int64)
        signature = signature.to(self.grad_buffers[0].device)
        low, high = signature.clone(), signature.clone()
        dist.all_reduce(low, op=dist.ReduceOp.MIN, group=self.tp_group)
        dist.all_reduce(high, op=dist.ReduceOp.MAX, group=self.tp_group)
        if low.item() != high.item():
            raise ValueError("ZeRO needs the same grad-buffer layout on every TP rank")

    # --- layout -----------------------------------------------------------------------------------

    def _pad_multiple(self, group, pad_multiple: int) -> int:
        del pad_multiple
        return group_size(group)  # buckets split into equal shards over the buffer's group

    def shard_range(self, buffer: GradBuffer, bucket: int) -> tuple[int, int]:
        """``[lo, hi)`` in buffer elements of this rank's shard of bucket ``bucket`` (over the
        buffer's DP group)."""
        return buffer.layout.shard_range(bucket, buffer.dp_size, buffer.dp_rank)

    def buffer_pairs(self) -> list[tuple[torch.Tensor, GradBuffer]]:
        """``(param_buffer, grad_buffer)`` per buffer key, in a fixed order."""
        return [(self.param_buffers[k], g) for k, g in self.buffers_by_key.items()]

    # --- grads ------------------------------------------------------------------------------------

    def zero_grad_buffer(self) -> None:
        """Start a step. The buffer is not cleared (a memset of the whole grad buffer, 5% of a
        CPU step): each parameter's first grad of the step is copied into ``main_grad`` instead
        of added, and ``finish_grad_sync`` zeroes the grads of parameters that got none."""
        self._unwritten = set(self._bucket_key)
        self._start_step()

    def _add_to_main_grad(self, param: nn.Parameter) -> None:
        """``main_grad = grad`` (the parameter's first grad of the step) or ``+= grad``."""
        if param in self._unwritten:
            param.main_grad.copy_(param.grad)
            self._unwritten.discard(param)
        else:
            param.main_grad.add_(param.grad)

    reduce_op = "reduce_scatter"

    def _start_reduce(self, bucket: Bucket) -> PendingReduceScatter:
        if bucket.data.dtype == torch.float16:  # fp16 range: divide before summing
            bucket.data.div_(self.dp_size)
        return start_reduce_scatter_shard(bucket.data, bucket.dp_group)

    def _finish_reduce(self, bucket: Bucket, pending: PendingReduceScatter) -> None:
        pending.wait()
        self._shard_mean(bucket)

    def _shard_mean(self, bucket: Bucket) -> None:
        if bucket.data.dtype != torch.float16:  # else divided before the sum
            lo, hi = self.shard_range(self.buffer_of(bucket.params[0]), bucket.index)
            bucket.data[lo - bucket.offset : hi - bucket.offset].div_(self.dp_size)

    def _reduce_bucket(self, bucket: Bucket) -> None:
        """This rank's shard of ``bucket.data`` <- its mean over the DP group (blocking)."""
        if bucket.data.dtype == torch.float16:
            bucket.data.div_(self.dp_size)
        reduce_scatter_shard(bucket.data, bucket.dp_group, scratch=self._scratch)
        self._shard_mean(bucket)

    def finish_grad_sync(self) -> None:
        self.finish_param_sync()
        for param in self._unwritten:  # no grad this step: zero, as a cleared buffer would be
            param.main_grad.zero_()
        self._unwritten.clear()
        all_reduce_flat([p.main_grad for p in self.shared_params], self.embedding_group)
        self._reduce_all_buckets()
        self._all_reduce_sp_shards()

    def _all_reduce_sp_shards(self) -> None:
        """Step 3: the shard's slices of sequence-parallel grads, summed over TP."""
        if group_size(self.tp_group) == 1 or not self._sp_params:
            return
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in self._sp_params:
            buffer = self.buffer_of(p)
            p_lo, p_hi, k = buffer.param_ranges[p]
            s_lo, s_hi = self.shard_range(buffer, k)
            lo, hi = max(p_lo, s_lo), min(p_hi, s_hi)
            if lo < hi:
                by_dtype.setdefault(buffer.grad_dtype, []).append(buffer.view(lo, hi))
        for grads in by_dtype.values():
            all_reduce_flat(grads, self.tp_group)

    # --- params -----------------------------------------------------------------------------------

    def gather_params(self) -> None:
        """Every rank's updated shard of every parameter bucket -> all DP ranks (with
        ``overlap_param_gather``: started in forward order, waited for by the forward)."""
        self.finish_param_sync()
        for key in reversed(list(self._buckets)):  # buckets are in reverse forward order
            bucket, param_data = self._buckets[key], self.param_buffers[self._buffer_key(key)]
            if group_size(bucket.dp_group) == 1:
                continue
            numel = self.grad_buffers[key[0]].layout.buckets[key[1]].numel
            view = param_data[bucket.offset : bucket.offset + numel]
            what = f"params of bucket {key[0]}.{key[1]}"
            if self.overlap_param_gather:
                self._gathering[key] = all_gather_shard(
                    view, bucket.dp_group, async_op=True, what=what
                )
            else:
                all_gather_shard(view, bucket.dp_group, what=what)

    def _buffer_key(self, key: BucketKey) -> BufferKey:
        return list(self.buffers_by_key)[key[0]]

    def _make_wait_hook(self, keys: list[BucketKey]):
        def wait_for_params(module, args):
            for key in keys:
                for work in self._gathering.pop(key, ()):
                    work.wait()

        return wait_for_params

    @contextlib.contextmanager
    def gathered_params(self) -> Iterator[None]:
        self.finish_param_sync()
        yield

    def finish_param_sync(self) -> None:
        """Wait for every parameter all-gather still in flight."""
        for works in self._gathering.values():
            for work in works:
                work.wait()
        self._gathering.clear()

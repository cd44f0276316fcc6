"""ZeRO-2 (``optim_grads``): gradients sharded too. Each bucket is reduce-scattered as soon as
backward has produced all its grads of a micro-batch, and only this rank's shard is kept.

    model = Zero2DataParallel(module, dp_group=ps.group("dp", "cp"), ...)
    model.zero_grad_buffer()
    forward_backward(...)           # buckets reduce-scatter from the grad hooks, every micro-batch
    model.finish_grad_sync()        # the rest (unused params, tied embeddings), then the DP mean
    optimizer.step()                # ShardedOptimizer, as under ZeRO-1

Storage: ``ShardedGradBuffer`` (``numel/d`` per rank) plus a full-size *staging* tensor per bucket
that is accumulating: allocated (zeroed) at the bucket's first grad, reduce-scattered when every
parameter of the bucket has its grad of this micro-batch, its shard added into the persistent
shard, then dropped. Grad bytes per rank: ``4P/d`` (fp32 grads) plus the buckets in flight.

Gradient accumulation: a bucket is reduced once per *micro-batch* (``no_sync`` is not needed and
does nothing here), so ``m`` micro-batches cost ``m`` reduce-scatters of the grads instead of one:
``m (d-1)/d`` of the grad bytes sent per rank and step, against ``(d-1)/d`` under ZeRO-1, which
keeps a whole grad buffer to accumulate in. That is the price of not holding the full grads.

Contract (as for ``overlap_grad_reduce``): every DP rank's backward produces grads for the same
parameters, so every rank reduces the same buckets in the same order. A bucket holding a parameter
that received no grad in a micro-batch stays staged; it is reduced in ``finish_grad_sync`` (after
accumulating over the later micro-batches, which is still the same sum). Buckets holding
``shared_params`` (tied embeddings with PP > 1) stay staged until ``finish_grad_sync`` sums them
over the embedding group, then reduce-scatter.

The mean: shards are summed over the bucket's group and divided by ``dp_size`` in
``finish_grad_sync`` (fp16 staging is divided before the sum, for range); then sequence-parallel
grads are summed over TP on the shard, as under ZeRO-1.
"""

from __future__ import annotations

import torch
from torch import nn

from megalite.core.distributed.data_parallel import BucketKey
from megalite.core.distributed.grad_buffer import Bucket
from megalite.core.distributed.shard_collectives import (
    reduce_scatter_shard,
    start_reduce_scatter_shard,
)
from megalite.core.distributed.sharded_grad_buffer import ShardedGradBuffer
from megalite.core.distributed.zero1_data_parallel import Zero1DataParallel
from megalite.core.groups import all_reduce_flat
from megalite.core.op_record import RECORDER


class Zero2DataParallel(Zero1DataParallel):
    """ZeRO-2 (module docstring). Arguments as ``Zero1DataParallel``; ``overlap_grad_reduce``
    leaves each bucket's reduce-scatter in flight until ``finish_grad_sync`` or the bucket's next
    grad (else it completes in the hook)."""

    zero_stage = 2  # the rung of the ladder (memory report)

    bucket_groups = None  # ZeRO-3 sets explicit buckets (its gather units)
    grad_home = "device"  # where the grad shards live (ZeRO-3's grad offload: host or file)

    def __init__(self, module: nn.Module, **kwargs):
        self._staged_peak = 0
        super().__init__(module, **kwargs)
        self._arrived: dict[BucketKey, set[nn.Parameter]] = {k: set() for k in self._buckets}
        self._pending: dict[BucketKey, object] = {}  # reduce-scatters in flight

    def _make_buffer(self, params: list[nn.Parameter], **kwargs) -> ShardedGradBuffer:
        groups = None if self.bucket_groups is None else self.bucket_groups(params)
        return ShardedGradBuffer(params, groups=groups, home=self.grad_home, **kwargs)

    # --- accumulation -----------------------------------------------------------------------------

    def zero_grad_buffer(self) -> None:
        """Start a step: zero the shards, drop every staging tensor."""
        self._wait_all()
        for buffer in self.grad_buffers:
            buffer.zero()
        for arrived in self._arrived.values():
            arrived.clear()
        self._start_step()

    def _accumulate(self, param: nn.Parameter) -> None:
        """Post-accumulate-grad hook: ``main_grad += grad`` in the bucket's staging tensor; when
        every parameter of the bucket has its grad of this micro-batch, reduce-scatter it."""
        if param.grad is None:
            return
        key = self._bucket_key[param]
        bucket, buffer = self._buckets[key], self.buffer_of(param)
        if key in self._pending:  # this bucket's previous reduce-scatter: finish it first
            self._complete(key)
        if bucket.data is None:
            buffer.stage(bucket)
            self._staged_peak = max(self._staged_peak, self.staged_bytes())
        param.main_grad.add_(param.grad)
        param.grad = None
        arrived = self._arrived[key]
        arrived.add(param)
        if len(arrived) == len(bucket.params):
            self._bucket_complete(key)

    def _bucket_complete(self, key: BucketKey) -> None:
        """Every parameter of bucket ``key`` has its grad of this micro-batch."""
        self._arrived[key].clear()
        if key not in self._deferred:
            self._reduce_staged(key, wait=not self.overlap_grad_reduce)

    def _reduce_staged(self, key: BucketKey, *, wait: bool) -> None:
        bucket = self._buckets[key]
        if bucket.data.dtype == torch.float16:  # fp16 range: divide before summing
            bucket.data.div_(self.dp_size)
        rec = self._record_reduce(key, posted=not wait)
        if wait:
            reduce_scatter_shard(bucket.data, bucket.dp_group, scratch=self._scratch)
            RECORDER.end(rec)
            self._add_shard(bucket)
        else:
            self._pending[key] = start_reduce_scatter_shard(bucket.data, bucket.dp_group)
            if rec is not None:
                self._reduce_records[key] = rec

    def _complete(self, key: BucketKey) -> None:
        rec = self._reduce_records.pop(key, None)
        RECORDER.wait(rec)
        self._pending.pop(key).wait()
        RECORDER.end(rec)
        self._add_shard(self._buckets[key])

    def _wait_all(self) -> None:
        for key in list(self._pending):
            self._complete(key)

    def _add_shard(self, bucket: Bucket) -> None:
        """The reduced shard of the staged ``bucket`` into the persistent shard; unstage."""
        buffer = self.buffer_of(bucket.params[0])
        staged, shard = buffer.shard_of_bucket(bucket)
        shard.add_(staged)
        buffer.unstage(bucket)

    def staged_bytes(self) -> int:
        """Bytes of staging tensors alive now (full-size buckets accumulating or in flight)."""
        return sum(b.staged_bytes() for b in self.grad_buffers)

    @property
    def staged_peak_bytes(self) -> int:
        return self._staged_peak

    # --- the step ---------------------------------------------------------------------------------

    def finish_grad_sync(self) -> None:
        self.finish_param_sync()
        self._wait_all()
        for key in sorted(self._deferred):  # shared params: summed over the embedding group first
            bucket = self._buckets[key]
            if bucket.data is None:
                self.buffer_of(bucket.params[0]).stage(bucket)
        all_reduce_flat([p.main_grad for p in self.shared_params], self.embedding_group)
        for key, bucket in self._buckets.items():  # partial buckets (unused params), deferred ones
            if bucket.data is not None:
                self._arrived[key].clear()
                self._reduce_staged(key, wait=True)
        for buffer in self.grad_buffers:
            if buffer.grad_dtype != torch.float16 and self.dp_size > 1:
                buffer.data.div_(self.dp_size)
        self._all_reduce_sp_shards()

    def _start_reduce(self, bucket: Bucket):
        raise AssertionError("ZeRO-2 reduces staged buckets only")

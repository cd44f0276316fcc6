"""Data-parallel wrapper: grads accumulate into contiguous buffers, then one sync per step.

    model = DistributedDataParallel(module, dp_group=ps.group("dp", "cp"), tp_group=ps.tp_group)
    model.zero_grad_buffer()
    with model.no_sync():            # every micro-batch but the last (the schedule does this)
        backward(micro_batch_0)
    backward(micro_batch_last)       # outside no_sync: each param's grad is now final
    model.finish_grad_sync()         # DP average per bucket, SP grads over TP, tied embeddings
    optimizer.step()

Accumulation: a post-accumulate-grad hook on every parameter adds ``param.grad`` into
``param.main_grad`` (the grad buffer, possibly fp32) and frees ``param.grad``, so micro-batches sum
in the buffer's dtype and at most one parameter's ``.grad`` is alive at a time.

The last micro-batch. The wrapper learns it only from ``no_sync()``: a grad that arrives outside
``no_sync`` is the parameter's last of the step. Once every parameter of a bucket has had its last
grad, the bucket is ready; with ``overlap_grad_reduce`` its reduction starts from the hook, so it
runs during the rest of backward. A grad arriving for a bucket whose reduction has started (a
backward run outside ``no_sync`` before the last micro-batch) is an error, not a silent wrong sum.

``finish_grad_sync`` then, in this order:
1. for each bucket (``_reduce_bucket``, or waiting for the one the hook started): divide by
   ``dp_size`` and all-reduce (sum) over the DP group, i.e. the grads of the mean loss over all DP
   replicas. ``Zero1DataParallel`` replaces this with a reduce-scatter of the same bucket;
2. sum over the TP group the grads of parameters marked ``sequence_parallel`` (they saw only
   ``s/tp`` positions);
3. sum over the embedding group the grads of ``shared_params`` (the word embedding held by the
   first and the last pipeline stage when input and output embeddings are tied and PP > 1).

Expert parameters. A parameter with ``expert_parallel = True`` (set by MoE layers) is replicated
over the *expert* data-parallel group ``expert_dp_group`` (``ps.group("edp")``), not over
``dp_group``: such parameters get grad buffers of their own (one per dtype), whose buckets are
summed (and, under ZeRO, sharded) over ``expert_dp_group`` and divided by the *dense* ``dp_size``:
the token all-to-all already summed every EP peer's contribution into the expert's grad, so
edp x ep covers the dp x cp loss sources once (Megatron scales expert grads the same way).
``buffers_by_key`` maps ``(param dtype, is_expert)`` to the buffer; each ``GradBuffer`` carries
its ``dp_group``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from megalite.core.distributed.grad_buffer import Bucket, GradBuffer
from megalite.core.distributed.sp_grads import sequence_parallel_params
from megalite.core.groups import all_reduce_flat, group_size
from megalite.core.op_record import RECORDER
from megalite.core.param_attributes import is_expert_param

BucketKey = tuple[int, int]  # (buffer index, bucket index)
BufferKey = tuple[torch.dtype, bool]  # (param dtype, expert parameter)


class DistributedDataParallel(nn.Module):
    """Wraps one model chunk; ``forward`` is the module's. See the module docstring for the step.

    ``bucket_size``: elements per bucket (None: one bucket per dtype). ``pad_multiple``: bucket
    padding (1 for all-reduce; ZeRO pads to its group's size for the reduce-scatter).
    ``overlap_grad_reduce``: start each bucket's reduction from the grad hook once it is ready
    (DP > 1 only). ``expert_dp_group``: the group of ``expert_parallel`` parameters (module
    docstring; None = a group of one).
    """

    zero_stage = 0  # the rung of the ladder (memory report)
    # the whole parameters ``gathered_params`` shows stay where they are, unchanged, until the
    # next optimizer step (an asynchronous save may copy them while forward and backward run)
    keeps_whole_params = True

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
        pad_multiple: int = 1,
        overlap_grad_reduce: bool = False,
        expert_dp_group=None,
    ):
        super().__init__()
        self.module = module
        self.dp_group, self.tp_group, self.embedding_group = dp_group, tp_group, embedding_group
        self.expert_dp_group = expert_dp_group
        self.dp_size = group_size(dp_group)
        # ZeRO-3's flat param shard per buffer key: param storage besides the module's params
        self.param_shards: dict[BufferKey, torch.Tensor] = {}
        self.shared_params = list(shared_params)
        self.overlap_grad_reduce = overlap_grad_reduce
        params = [p for p in module.parameters() if p.requires_grad]
        by_key: dict[BufferKey, list[nn.Parameter]] = {}
        for p in params:
            by_key.setdefault((p.dtype, is_expert_param(p)), []).append(p)
        self.buffers_by_key: dict[BufferKey, GradBuffer] = {}
        for (dtype, expert), group_params in sorted(by_key.items(), key=lambda kv: kv[0][1]):
            grad_dtype = torch.float32 if accumulate_allreduce_grads_in_fp32 else dtype
            group = expert_dp_group if expert else dp_group
            self.buffers_by_key[dtype, expert] = self._make_buffer(
                group_params,
                grad_dtype=grad_dtype,
                bucket_size=bucket_size,
                pad_multiple=self._pad_multiple(group, pad_multiple),
                device=group_params[0].device,
                dp_group=group,
                expert=expert,
            )
        self._buckets: dict[BucketKey, Bucket] = {
            (i, b.index): b for i, buf in enumerate(self.grad_buffers) for b in buf.buckets
        }
        self._bucket_key: dict[nn.Parameter, BucketKey] = {
            p: (i, k)
            for i, buf in enumerate(self.grad_buffers)
            for p, (_, _, k) in buf.param_ranges.items()
        }
        self._names = {p: n for n, p in module.named_parameters()}
        self._sp_params = sequence_parallel_params(params)
        self._sync_enabled = True  # False inside no_sync()
        self.grad_reduce = True  # False: grads stay local (set_grad_reduce)
        self._ready: dict[BucketKey, set[nn.Parameter]] = {k: set() for k in self._buckets}
        self._deferred: set[BucketKey] = set()  # ready buckets the hook must not start
        self._reducing: dict[BucketKey, object] = {}  # reductions in flight (``.wait()``)
        self._reduce_records: dict[BucketKey, object] = {}  # their op records, when recording
        # the hooks live in C++, where Python's GC does not see the cycle they make (parameter ->
        # hook -> wrapper -> module -> parameter): ``remove_hooks`` breaks it at the end of a run
        self._hooks = [p.register_post_accumulate_grad_hook(self._accumulate) for p in params]

    def remove_hooks(self) -> None:
        """Unregister the grad hooks (the run is over): the wrapper, its module and its grad
        buffers, with the process groups they hold, can then be freed. Every rank calls it at the
        same point, so no rank's hooks stop while another's still reduce."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _pad_multiple(self, group, pad_multiple: int) -> int:
        del group
        return pad_multiple

    def _make_buffer(self, params: list[nn.Parameter], **kwargs) -> GradBuffer:
        return GradBuffer(params, **kwargs)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @property
    def grad_buffers(self) -> list[GradBuffer]:
        return list(self.buffers_by_key.values())

    def buffer_of(self, param: nn.Parameter) -> GradBuffer:
        """The grad buffer holding ``param``'s grad."""
        return self.buffers_by_key[param.dtype, is_expert_param(param)]

    # --- accumulation and the last micro-batch ----------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Grads arriving inside are not the last of the step: they accumulate, no bucket becomes
        ready. Schedules run the backward of every micro-batch but the last inside it."""
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def _accumulate(self, param: nn.Parameter) -> None:
        """Post-accumulate-grad hook: ``main_grad += grad``, free ``grad``; outside ``no_sync``
        mark the parameter ready (and start its bucket's reduction when the bucket is ready)."""
        if param.grad is None:
            return
        key = self._bucket_key[param]
        if key in self._reducing:
            raise RuntimeError(
                f"a grad of {self._names[param]} arrived for bucket {key} after its reduction "
                "started: a backward ran outside no_sync() before the last micro-batch"
            )
        self._add_to_main_grad(param)
        param.grad = None
        if not self._sync_enabled:
            return
        ready = self._ready[key]
        ready.add(param)
        if (
            self.overlap_grad_reduce
            and group_size(self._buckets[key].dp_group) > 1
            and len(ready) == len(self._buckets[key].params)
            and key not in self._deferred
            and self.grad_reduce
        ):
            self._launch_reduce(key)

    def _add_to_main_grad(self, param: nn.Parameter) -> None:
        param.main_grad.add_(param.grad)

    def zero_grad_buffer(self) -> None:
        """Start a step: zero every buffer (call before the first micro-batch)."""
        for buffer in self.grad_buffers:
            buffer.zero()
        self._start_step()

    def _start_step(self) -> None:
        for p in self.module.parameters():
            p.grad = None
        for ready in self._ready.values():
            ready.clear()
        self._reducing.clear()
        self._reduce_records.clear()

    # --- the reduction ----------------------------------------------------------------------------

    reduce_op = "all_reduce"  # what the op recorder calls a bucket's reduction

    def _record_reduce(self, key: BucketKey, *, posted: bool):
        """The op recorder's record of bucket ``key``'s reduction (None when it is off)."""
        if not RECORDER.enabled:
            return None
        bucket = self._buckets[key]
        record = RECORDER.post if posted else RECORDER.begin
        return record(
            self.reduce_op,
            group=bucket.dp_group,
            axis="dp",
            what=f"grad bucket {key[0]}.{key[1]}",
            shape=bucket.data.shape,
        )

    def _launch_reduce(self, key: BucketKey) -> None:
        rec = self._record_reduce(key, posted=True)
        self._reducing[key] = self._start_reduce(self._buckets[key])
        if rec is not None:
            self._reduce_records[key] = rec

    def _start_reduce(self, bucket: Bucket):
        """Launch ``_reduce_bucket`` asynchronously; returns what ``_finish_reduce`` waits on."""
        bucket.data.div_(self.dp_size)
        return dist.all_reduce(bucket.data, group=bucket.dp_group, async_op=True)

    def _finish_reduce(self, bucket: Bucket, pending) -> None:
        del bucket
        pending.wait()

    def _reduce_bucket(self, bucket: Bucket) -> None:
        """Sum ``bucket.data`` over its DP group, divided by ``dp_size`` (blocking)."""
        bucket.data.div_(self.dp_size)
        dist.all_reduce(bucket.data, group=bucket.dp_group)

    def _reduce_all_buckets(self) -> None:
        """Every bucket reduced over its DP group: waits for those the hooks started, runs the
        rest. A bucket over a group of one is only divided by ``dp_size`` (an expert bucket when
        EP spans the whole DP group)."""
        if self.dp_size == 1:
            return
        if not self.grad_reduce:
            for bucket in self._buckets.values():
                bucket.data.mul_(group_size(bucket.dp_group) / self.dp_size)
            return
        buckets = {}
        for key, bucket in self._buckets.items():
            if group_size(bucket.dp_group) > 1:
                buckets[key] = bucket
            else:
                bucket.data.div_(self.dp_size)
        if self.overlap_grad_reduce:
            for key in buckets:
                if key not in self._reducing:
                    self._launch_reduce(key)
            for key, pending in self._reducing.items():
                rec = self._reduce_records.pop(key, None)
                RECORDER.wait(rec)
                self._finish_reduce(self._buckets[key], pending)
                RECORDER.end(rec)
            self._reducing.clear()
        else:
            for key, bucket in buckets.items():
                rec = self._record_reduce(key, posted=False)
                self._reduce_bucket(bucket)
                RECORDER.end(rec)

    def set_grad_reduce(self, enabled: bool) -> None:
        """Whether ``finish_grad_sync`` averages the buckets over DP. Off, each rank keeps its own
        grads, scaled as one term of that average (``group size / dp_size``: 1 for dense ones),
        for an optimizer that communicates something else (the compressed optimizers' momentum);
        the SP and tied-embedding reductions still run."""
        self.grad_reduce = enabled

    def finish_grad_sync(self) -> None:
        self._reduce_all_buckets()
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in self._sp_params:
            by_dtype.setdefault(p.main_grad.dtype, []).append(p.main_grad)
        for grads in by_dtype.values():
            all_reduce_flat(grads, self.tp_group)
        all_reduce_flat([p.main_grad for p in self.shared_params], self.embedding_group)

    @contextlib.contextmanager
    def gathered_params(self) -> Iterator[None]:
        """Every parameter of ``module`` whole and current inside (ZeRO-3 gathers its shards
        here; a no-op for the rungs that keep whole parameters)."""
        yield

    # --- memory figures (the memory report); the sharded rungs override them ----------------------

    def staged_bytes(self) -> int:
        """Bytes of grad buckets staged now (ZeRO-2/3's full-size buckets; none here)."""
        return 0

    @property
    def staged_peak_bytes(self) -> int:
        """The most staged bytes at once during the step (ZeRO-2/3; none here)."""
        return 0

    @property
    def param_peak_bytes(self) -> int:
        """The most whole-unit param bytes resident at once (ZeRO-3; none here)."""
        return 0

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

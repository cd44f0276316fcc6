"""Data-parallel wrapper: grads accumulate into contiguous buffers, then one sync per step.

    model = DistributedDataParallel(module, dp_group=ps.dp_group, tp_group=ps.tp_group, ...)
    model.zero_grad_buffer()
    forward_backward(...)            # micro-batches; each param's grad is added into main_grad
    model.finish_grad_sync()         # DP average per bucket, SP grads over TP, tied embeddings
    optimizer.step()

Accumulation: a post-accumulate-grad hook on every parameter adds ``param.grad`` into
``param.main_grad`` (the grad buffer, possibly fp32) and frees ``param.grad``, so micro-batches sum
in the buffer's dtype and at most one parameter's ``.grad`` is alive at a time.

``finish_grad_sync`` then, in this order:
1. for each bucket, ``_reduce_bucket``: divide by ``dp_size`` and all-reduce (sum) over the DP
   group, i.e. the grads of the mean loss over all DP replicas. ZeRO-1 (issue 5) overrides this
   method with a reduce-scatter of the same bucket; an ``--overlap-grad-reduce`` version launches
   it from the hook once ``bucket.params_ready`` is full (the bookkeeping is kept here already);
2. sum over the TP group the grads of parameters marked ``sequence_parallel`` (they saw only
   ``s/tp`` positions);
3. sum over the embedding group the grads of ``shared_params`` (the word embedding held by the
   first and the last pipeline stage when input and output embeddings are tied and PP > 1).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from megalite.core.distributed.grad_buffer import Bucket, GradBuffer
from megalite.core.distributed.sp_grads import sequence_parallel_params
from megalite.core.tensor_parallel.mappings import group_size


def all_reduce_flat(tensors: list[torch.Tensor], group) -> None:
    """Sum ``tensors`` (same dtype) over ``group`` in one collective, in place."""
    if group_size(group) == 1 or not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


class DistributedDataParallel(nn.Module):
    """Wraps one model stage; ``forward`` is the module's. See the module docstring for the step.

    ``bucket_size``: elements per bucket (None: one bucket per dtype). ``pad_multiple``: bucket
    padding (1 for all-reduce; ``dp_size`` for ZeRO-1's reduce-scatter).
    """

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
    ):
        super().__init__()
        self.module = module
        self.dp_group, self.tp_group, self.embedding_group = dp_group, tp_group, embedding_group
        self.dp_size = group_size(dp_group)
        self.shared_params = list(shared_params)
        params = [p for p in module.parameters() if p.requires_grad]
        by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
        for p in params:
            by_dtype.setdefault(p.dtype, []).append(p)
        self.buffers_by_dtype: dict[torch.dtype, GradBuffer] = {}
        for dtype, group_params in by_dtype.items():
            grad_dtype = torch.float32 if accumulate_allreduce_grads_in_fp32 else dtype
            self.buffers_by_dtype[dtype] = GradBuffer(
                group_params,
                grad_dtype=grad_dtype,
                bucket_size=bucket_size,
                pad_multiple=pad_multiple,
                device=group_params[0].device,
            )
        self._sp_params = sequence_parallel_params(params)
        self._hooks = [p.register_post_accumulate_grad_hook(self._accumulate) for p in params]

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @property
    def grad_buffers(self) -> list[GradBuffer]:
        return list(self.buffers_by_dtype.values())

    def _buffer_of(self, param: nn.Parameter) -> GradBuffer:
        return self.buffers_by_dtype[param.dtype]

    def _accumulate(self, param: nn.Parameter) -> None:
        """Post-accumulate-grad hook: ``main_grad += grad``; free ``grad``."""
        if param.grad is None:
            return
        param.main_grad.add_(param.grad)
        param.grad = None
        bucket = self._buffer_of(param).bucket_of(param)
        bucket.params_ready.add(id(param))

    def zero_grad_buffer(self) -> None:
        """Zero every buffer (call before the first micro-batch of a step)."""
        for buffer in self.grad_buffers:
            buffer.zero()
        for p in self.module.parameters():
            p.grad = None

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Grad sync happens only in ``finish_grad_sync`` today, so this is a no-op; it is the
        place where ``--overlap-grad-reduce`` will suppress the hook-launched reductions."""
        yield

    def _reduce_bucket(self, bucket: Bucket) -> None:
        """Average ``bucket.data`` over the DP group."""
        if self.dp_size == 1:
            return
        bucket.data.div_(self.dp_size)
        dist.all_reduce(bucket.data, group=self.dp_group)

    def finish_grad_sync(self) -> None:
        for buffer in self.grad_buffers:
            for bucket in buffer.buckets:
                self._reduce_bucket(bucket)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in self._sp_params:
            by_dtype.setdefault(p.main_grad.dtype, []).append(p.main_grad)
        for grads in by_dtype.values():
            all_reduce_flat(grads, self.tp_group)
        all_reduce_flat([p.main_grad for p in self.shared_params], self.embedding_group)

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

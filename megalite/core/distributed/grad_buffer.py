"""A contiguous gradient buffer per dtype, cut into buckets for the data-parallel collectives.

Every trainable parameter gets ``param.main_grad``, a view into one flat buffer, so the
data-parallel reduction is a few large collectives over contiguous memory instead of one per
parameter. The buffer's dtype is the parameters' dtype, or fp32 with
``accumulate_allreduce_grads_in_fp32`` (bf16 / fp16 training: micro-batch grads are summed and
all-reduced in fp32).

Layout: parameters are placed in *reverse* registration order (the order their grads become ready
in backward), and consecutive parameters are grouped into buckets of at least ``bucket_size``
elements (the last bucket takes the rest; ``None`` = a single bucket). Each bucket is padded to a
multiple of ``pad_multiple`` elements (ZeRO-1 passes ``dp_size`` so a bucket splits evenly into
per-rank shards for a reduce-scatter); padding stays zero. A parameter never straddles buckets.

    buffer.data   [numel_padded]             one flat tensor
    bucket.data   [bucket_numel_padded]      a view of buffer.data
    param.main_grad = buffer.data[start:end].view(param.shape)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Bucket:
    """A contiguous slice ``[offset, offset + numel)`` of a grad buffer and the params inside it."""

    index: int
    params: list[torch.nn.Parameter]
    data: torch.Tensor  # [numel] view of the buffer, padding included
    offset: int  # start of this bucket in the buffer (elements)
    params_ready: set[int] = field(default_factory=set)  # id(param) whose grads are final


class GradBuffer:
    """Holds ``main_grad`` for ``params`` (all of one param dtype) in a buffer of ``grad_dtype``.

    ``param_ranges[param]`` = ``(start, end, bucket_index)`` in buffer elements.
    """

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        *,
        grad_dtype: torch.dtype,
        bucket_size: int | None = None,
        pad_multiple: int = 1,
        device: torch.device | None = None,
    ):
        if bucket_size is not None and bucket_size < 1:
            raise ValueError(f"--ddp-bucket-size must be >= 1 element, got {bucket_size}")
        if pad_multiple < 1:
            raise ValueError(f"pad_multiple must be >= 1, got {pad_multiple}")
        self.grad_dtype, self.pad_multiple = grad_dtype, pad_multiple
        ordered = list(reversed(params))

        # plan: (bucket params, start offsets) without allocating
        bucket_plans: list[tuple[list[torch.nn.Parameter], int, int]] = []  # params, offset, numel
        ranges: dict[int, tuple[int, int]] = {}
        offset, current, current_numel = 0, [], 0
        for i, p in enumerate(ordered):
            ranges[id(p)] = (offset + current_numel, offset + current_numel + p.numel())
            current.append(p)
            current_numel += p.numel()
            last = i == len(ordered) - 1
            if last or (bucket_size is not None and current_numel >= bucket_size):
                padded = -(-current_numel // pad_multiple) * pad_multiple
                bucket_plans.append((current, offset, padded))
                offset += padded
                current, current_numel = [], 0

        self.numel = offset
        self.data = torch.zeros(offset, dtype=grad_dtype, device=device)
        self.buckets: list[Bucket] = []
        self.param_ranges: dict[torch.nn.Parameter, tuple[int, int, int]] = {}
        for index, (bucket_params, start, numel) in enumerate(bucket_plans):
            self.buckets.append(
                Bucket(index, bucket_params, self.data[start : start + numel], start)
            )
            for p in bucket_params:
                lo, hi = ranges[id(p)]
                p.main_grad = self.data[lo:hi].view(p.shape)
                self.param_ranges[p] = (lo, hi, index)

    def zero(self) -> None:
        self.data.zero_()
        for bucket in self.buckets:
            bucket.params_ready.clear()

    def bucket_of(self, param: torch.nn.Parameter) -> Bucket:
        return self.buckets[self.param_ranges[param][2]]

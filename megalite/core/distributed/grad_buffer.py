"""A contiguous gradient buffer per dtype, cut into buckets for the data-parallel collectives.

Two halves: ``GradBufferLayout`` says where everything sits (pure arithmetic on element counts, no
tensor); ``GradBuffer`` is the storage built from it (one flat tensor and the ``main_grad`` views).
ZeRO-2 will keep only this rank's shard of the storage, so code outside ``GradBuffer`` reads grads
through ``GradBuffer.view(lo, hi)`` in buffer coordinates, not through ``.data``.

Every trainable parameter gets ``param.main_grad``, a view into the flat buffer, so the
data-parallel reduction is a few large collectives over contiguous memory instead of one per
parameter. The buffer's dtype is the parameters' dtype, or fp32 with
``accumulate_allreduce_grads_in_fp32`` (bf16 / fp16 training: micro-batch grads are summed and
reduced in fp32).

Layout: parameters are placed in *reverse* registration order (the order their grads become ready
in backward), and consecutive parameters are grouped into buckets of at least ``bucket_size``
elements (the last bucket takes the rest; ``None`` = a single bucket). Each bucket is padded to a
multiple of ``pad_multiple`` elements (ZeRO passes ``dp_size`` so a bucket splits evenly into
per-rank shards for a reduce-scatter); padding stays zero. A parameter never straddles buckets.
DP rank ``r`` of ``d`` owns elements ``[offset + r n/d, offset + (r+1) n/d)`` of a bucket of ``n``
(padded) elements at ``offset``. ZeRO-3 passes explicit ``groups`` instead: one bucket per
parameter group (a gather unit: a transformer layer, the embedding, the output layer)::

    buffer.data   [numel_padded]             one flat tensor
    bucket.data   [bucket_numel_padded]      a view of buffer.data
    param.main_grad = buffer.data[start:end].view(param.shape)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megalite.core.groups import group_rank, group_size


@dataclass(frozen=True)
class BucketRange:
    """Elements ``[offset, offset + numel)`` of the buffer (padding included); ``params`` are the
    registration indices of the parameters inside, in placement order."""

    index: int
    offset: int
    numel: int
    params: tuple[int, ...]


class GradBufferLayout:
    """Where each of ``numels`` (parameter sizes, registration order) sits; allocates nothing.

    ``param_ranges[i]`` = ``(start, end, bucket_index)`` of parameter ``i`` in buffer elements;
    ``buckets`` in buffer order; ``numel`` = the padded total.
    """

    def __init__(
        self,
        numels: Sequence[int],
        *,
        bucket_size: int | None = None,
        pad_multiple: int = 1,
        groups: Sequence[Sequence[int]] | None = None,
    ):
        if bucket_size is not None and bucket_size < 1:
            raise ValueError(f"bucket_size must be >= 1 element, got {bucket_size}")
        if pad_multiple < 1:
            raise ValueError(f"pad_multiple must be >= 1, got {pad_multiple}")
        self.pad_multiple = pad_multiple
        self.param_ranges: list[tuple[int, int, int]] = [(0, 0, 0)] * len(numels)
        self.buckets: list[BucketRange] = []
        offset, current, current_numel = 0, [], 0
        order = list(reversed(range(len(numels))))
        ends = set()  # ZeRO-3: ``groups`` (parameter indices, placement order) are the buckets
        if groups is not None:
            order = [i for g in groups for i in g]
            if sorted(order) != list(range(len(numels))):
                raise ValueError("bucket groups must hold every parameter index exactly once")
            ends = {sum(len(g) for g in groups[: j + 1]) - 1 for j in range(len(groups))}
            bucket_size = None
        for k, i in enumerate(order):
            start = offset + current_numel
            self.param_ranges[i] = (start, start + numels[i], len(self.buckets))
            current.append(i)
            current_numel += numels[i]
            if (
                k == len(order) - 1
                or k in ends
                or (bucket_size is not None and current_numel >= bucket_size)
            ):
                padded = -(-current_numel // pad_multiple) * pad_multiple
                self.buckets.append(BucketRange(len(self.buckets), offset, padded, tuple(current)))
                offset += padded
                current, current_numel = [], 0
        self.numel = offset

    def shard_range(self, bucket: int, dp_size: int, dp_rank: int) -> tuple[int, int]:
        """``[lo, hi)`` in buffer elements of DP rank ``dp_rank``'s shard of bucket ``bucket``."""
        b = self.buckets[bucket]
        if b.numel % dp_size:
            raise ValueError(
                f"bucket {bucket} of {b.numel} elements does not split into {dp_size} equal "
                f"shards (pad_multiple is {self.pad_multiple})"
            )
        size = b.numel // dp_size
        return b.offset + dp_rank * size, b.offset + (dp_rank + 1) * size

    def shard_segments(self, dp_size: int, dp_rank: int) -> list[tuple[int, int, int]]:
        """One ``(lo, hi, shard_lo)`` per bucket: the rank's shard of the bucket in buffer elements
        and where it starts in the rank's flat shard (every bucket's shard, concatenated)."""
        out, shard_lo = [], 0
        for b in self.buckets:
            lo, hi = self.shard_range(b.index, dp_size, dp_rank)
            out.append((lo, hi, shard_lo))
            shard_lo += hi - lo
        return out


@dataclass
class Bucket:
    """The storage of one ``BucketRange``: its parameters and a view of the buffer."""

    index: int
    params: list[torch.nn.Parameter]
    data: torch.Tensor  # [numel] view of the buffer, padding included
    offset: int  # start of this bucket in the buffer (elements)
    dp_group: object = None  # the group this bucket is reduced over (the buffer's)


class GradBuffer:
    """Holds ``main_grad`` for ``params`` (all of one param dtype) in a buffer of ``grad_dtype``.

    ``layout`` is the ``GradBufferLayout``; ``param_ranges[param]`` = ``(start, end,
    bucket_index)`` in buffer elements. ``dp_group``: the data-parallel group the buffer is reduced
    (and, under ZeRO, sharded) over: ``dp x cp`` for dense parameters, ``edp`` for expert ones
    (``expert`` True).
    """

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        *,
        grad_dtype: torch.dtype,
        bucket_size: int | None = None,
        pad_multiple: int = 1,
        device: torch.device | None = None,
        dp_group=None,
        expert: bool = False,
    ):
        self.dp_group, self.expert = dp_group, expert
        self.dp_size, self.dp_rank = group_size(dp_group), group_rank(dp_group)
        self.layout = GradBufferLayout(
            [p.numel() for p in params], bucket_size=bucket_size, pad_multiple=pad_multiple
        )
        self.grad_dtype, self.params = grad_dtype, list(params)
        self.device = torch.device(device or "cpu")  # where the params compute (``data`` too)
        self.data = torch.zeros(self.layout.numel, dtype=grad_dtype, device=device)
        self.param_ranges = {p: self.layout.param_ranges[i] for i, p in enumerate(self.params)}
        self.buckets = [
            Bucket(
                b.index,
                [self.params[i] for i in b.params],
                self.view(b.offset, b.offset + b.numel),
                b.offset,
                dp_group,
            )
            for b in self.layout.buckets
        ]
        for p, (lo, hi, _) in self.param_ranges.items():
            p.main_grad = self.view(lo, hi).view(p.shape)

    @property
    def numel(self) -> int:
        return self.layout.numel

    def view(self, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of the buffer (buffer coordinates)."""
        return self.data[lo:hi]

    def zero(self) -> None:
        self.data.zero_()

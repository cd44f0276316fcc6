"""ZeRO-2's grad buffer: only this rank's shard of every bucket is kept between micro-batches.

Same ``GradBufferLayout`` as ``GradBuffer`` (buckets padded to the group size, rank ``r`` owns the
``r``-th equal part of each), but the persistent storage is the rank's *shard*: the shards of all
buckets concatenated, ``numel / dp_size`` elements::

    data            [numel/d]        grad dtype; the reduced grads of this rank's elements
    bucket.data     [bucket numel]   a *staging* tensor while the bucket accumulates, else None
    param.main_grad                  a view of its bucket's staging tensor (while staged)

``stage(bucket)`` allocates a zeroed full-size bucket when its first grad of a micro-batch
arrives; ``unstage(bucket)`` drops it once its reduce-scatter has been added into ``data``. So
grad bytes per rank are ``numel/d`` plus the buckets in flight. ``view(lo, hi)`` keeps
``GradBuffer``'s buffer coordinates: it serves any range inside this rank's shard of one bucket
(the optimizer and the SP-grad sum read grads only there). ZeRO-3 may keep ``data`` on the host,
or in a file (``home``).
"""

from __future__ import annotations

import bisect

import torch

from megalite.core.distributed.grad_buffer import Bucket, GradBuffer, GradBufferLayout
from megalite.core.groups import group_rank, group_size

HOMES = ("device", "host", "file")  # where ``data`` lives (ZeRO-3's grad offload: host or file)


class ShardedGradBuffer(GradBuffer):
    """A ``GradBuffer`` that stores only this rank's shard (module docstring). Arguments as
    ``GradBuffer`` plus ``groups`` (explicit buckets, see ``GradBufferLayout``) and ``home``: the
    shard on the device, on the host (pinned under CUDA) or in a file its owner writes (``data``
    then holds no element; staging stays on ``device``)."""

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
        groups=None,
        home: str = "device",
    ):
        self.dp_group, self.expert = dp_group, expert
        self.dp_size, self.dp_rank = group_size(dp_group), group_rank(dp_group)
        self.layout = GradBufferLayout(
            [p.numel() for p in params],
            bucket_size=bucket_size,
            pad_multiple=pad_multiple,
            groups=groups,
        )
        self.grad_dtype, self.params = grad_dtype, list(params)
        self.device = torch.device(device or "cpu")  # where the params compute: the staging too
        self.segments = self.layout.shard_segments(self.dp_size, self.dp_rank)
        self._starts = [lo for lo, _, _ in self.segments]
        self.shard_numel = sum(hi - lo for lo, hi, _ in self.segments)
        if home not in HOMES:
            raise ValueError(f"grad shard home must be one of {HOMES}, got {home!r}")
        self.home = home
        if home == "file":  # the owner keeps the shard in a file: no bytes here
            self.data = torch.zeros(0, dtype=grad_dtype, device=device)
        elif home == "host":
            pin = torch.device(device or "cpu").type == "cuda"
            self.data = torch.zeros(self.shard_numel, dtype=grad_dtype, pin_memory=pin)
        else:
            self.data = torch.zeros(self.shard_numel, dtype=grad_dtype, device=device)
        self.param_ranges = {p: self.layout.param_ranges[i] for i, p in enumerate(self.params)}
        self.buckets = [
            Bucket(b.index, [self.params[i] for i in b.params], None, b.offset, dp_group)
            for b in self.layout.buckets
        ]

    def view(self, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` (buffer coordinates) of this rank's shard storage; the range must
        lie inside the shard of one bucket."""
        k = bisect.bisect_right(self._starts, lo) - 1
        s_lo, s_hi, shard_lo = self.segments[max(k, 0)]
        if k < 0 or hi > s_hi or lo < s_lo:
            raise IndexError(f"[{lo}, {hi}) is not inside this rank's shard of one bucket")
        return self.data[shard_lo + lo - s_lo : shard_lo + hi - s_lo]

    def shard_of_bucket(self, bucket: Bucket) -> tuple[torch.Tensor, torch.Tensor]:
        """(this rank's part of the staged ``bucket.data``, where it accumulates in ``data``)."""
        lo, hi, shard_lo = self.segments[bucket.index]
        staged = bucket.data[lo - bucket.offset : hi - bucket.offset]
        return staged, self.data[shard_lo : shard_lo + hi - lo]

    def stage(self, bucket: Bucket) -> None:
        """A zeroed full-size staging tensor for ``bucket``; its params' ``main_grad`` view it."""
        numel = self.layout.buckets[bucket.index].numel
        bucket.data = torch.zeros(numel, dtype=self.grad_dtype, device=self.device)
        for p in bucket.params:
            lo, hi, _ = self.param_ranges[p]
            p.main_grad = bucket.data[lo - bucket.offset : hi - bucket.offset].view(p.shape)

    def unstage(self, bucket: Bucket) -> None:
        bucket.data = None
        for p in bucket.params:
            p.main_grad = None

    def staged_bytes(self) -> int:
        return sum(
            b.data.numel() * b.data.element_size() for b in self.buckets if b.data is not None
        )

    def zero(self) -> None:
        self.data.zero_()
        for bucket in self.buckets:
            self.unstage(bucket)

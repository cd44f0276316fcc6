"""ZeRO-3's reduced grad shards in files (``grad_files``), beside the param files.

    files = GradFiles(store, grad_buffers, dp_size=d)   # one ``<prefix>_b<i>.grad`` per buffer
    files.put(i, bucket_index, staged_part)   # a unit's reduced part: written, then added
    files.fill_unwritten()                    # finish_grad_sync: buckets without grads -> zeros
    g = files.read(i, lo, hi)                 # shard elements [lo, hi): the DP mean
    files.new_step()

A file holds what ``ShardedGradBuffer.data`` would (the buffer's shard, in shard coordinates) but
undivided: a bucket's first reduced part of a step is written and later ones (micro-batches) are
added, through the store's bounded write buffer; ``read`` divides by the DP size as the grads come
back, where ZeRO-2 divides ``data`` in ``finish_grad_sync`` (fp16 grads are divided before the sum
in both). So the grads never exist whole on the host, and nothing is zeroed on disk per step.
"""

from __future__ import annotations

import torch

from megalite.core.distributed.param_offload import ParamStore
from megalite.core.distributed.sharded_grad_buffer import ShardedGradBuffer


class GradFiles:
    """One file per buffer of ``buffers`` in ``store`` (module docstring); not for expert
    buffers, nor sequence-parallel grads summed over TP (``sp_over_tp``)."""

    def __init__(
        self,
        store: ParamStore,
        buffers: list[ShardedGradBuffer],
        *,
        dp_size: int,
        sp_over_tp: bool = False,
    ):
        if store.place != "disk":
            raise ValueError(
                "grad_files keeps the grad shards beside the param files: give param_offload a "
                "directory"
            )
        if any(b.expert for b in buffers):
            raise ValueError("grad_files does not serve expert parameters: drop grad_files")
        if sp_over_tp:
            raise ValueError(
                "grad_files does not sum sequence-parallel grads over tensor parallel: drop "
                "grad_files or sequence_parallel"
            )
        self.store, self.buffers, self.dp_size = store, buffers, dp_size
        self.files = [
            store.create(f"b{i}", b.shard_numel, b.grad_dtype, suffix="grad")
            for i, b in enumerate(buffers)
        ]
        self._written: set[tuple[int, int]] = set()  # (buffer, bucket) parts written this step

    def new_step(self) -> None:
        """The next parts overwrite the last step's."""
        self._written.clear()

    def put(self, i: int, bucket: int, part: torch.Tensor) -> None:
        """Bucket ``bucket``'s reduced part of buffer ``i``: written (first of the step) or
        added."""
        s = self.buffers[i].segments[bucket][2]
        if (i, bucket) in self._written:
            self.store.add(self.files[i], s, part)
        else:
            self.store.write(self.files[i], s, part)
            self._written.add((i, bucket))

    def fill_unwritten(self) -> None:
        """Zeros for the buckets that got no grad this step (as a zeroed shard would hold)."""
        for i, buffer in enumerate(self.buffers):
            for bucket, (lo, hi, _) in enumerate(buffer.segments):
                if (i, bucket) not in self._written:
                    self.put(i, bucket, torch.zeros(hi - lo, dtype=buffer.grad_dtype))

    def read(self, i: int, lo: int, hi: int) -> torch.Tensor:
        """Shard elements ``[lo, hi)`` of buffer ``i``'s grads: the DP mean."""
        grads = self.store.read(self.files[i], lo, hi)
        if self.buffers[i].grad_dtype != torch.float16 and self.dp_size > 1:
            grads.div_(self.dp_size)
        return grads

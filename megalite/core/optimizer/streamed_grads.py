"""The grads of a ZeRO-3 model that keeps its grad shards in files (``GradFiles``), as the sharded
optimizer streams them in chunks of its NVMe store's size:

    grads = StreamedGrads(model.grad_files, shard_states, pieces, loss_scaler=None, ...)
    norm = grads.norm(pieces, groups=..., device=...)   # one read pass over the counted pieces
    grads.clip(norm, max_norm)                         # remembers the coefficient
    g = grads.read(b, lo, hi)   # in the update pass: the DP mean, times the clip coefficient

``read`` gives exactly what the in-memory path computes (the shard divided by the DP size, then
multiplied by the clip coefficient, element by element). The norm adds the chunks' squares in
fp64, so it does not depend on the chunking; it differs from the in-memory one (torch's fp32
``_foreach_norm`` per piece, which on CPU drifts by ~1e-5 relative over a million-element piece)
by that one's rounding. The files serve the whole state on disk, without a loss scaler (fp16) or
a zero count.
"""

from __future__ import annotations

import torch

from megalite.core.distributed.grad_files import GradFiles
from megalite.core.optimizer.grad_norm import all_reduce_over, clip_coefficient
from megalite.core.optimizer.nvme_store import Span, chunk_spans
from megalite.core.optimizer.sharded_state import ShardState


class StreamedGrads:
    def __init__(
        self,
        files: GradFiles,
        states: list[ShardState],
        pieces: list,
        *,
        loss_scaler,
        count_zeros: bool,
    ):
        if loss_scaler is not None or count_zeros:
            raise ValueError("grads in files (grad_files) take no loss scaler and no count_zeros")
        if any(pc.where != "disk" for pc in pieces):
            raise ValueError("grads in files (grad_files) need the whole optimizer state in files")
        self.files = files
        self.chunk = min((s.store.chunk for s in states if s.store is not None), default=1)
        self.coefficient: torch.Tensor | None = None  # the step's clip coefficient

    def read(self, b: int, lo: int, hi: int) -> torch.Tensor:
        """Shard elements ``[lo, hi)`` of buffer ``b``'s grads, fp32, the mean and clipped."""
        grads = self.files.read(b, lo, hi).float()
        if self.coefficient is not None:
            grads.mul_(self.coefficient.to(grads.device))
        return grads

    def norm(self, pieces: list, *, groups, device: torch.device) -> torch.Tensor:
        """The 2-norm of the counted ``pieces``' grads over ``groups``; resets the clip
        coefficient (a new step). Each buffer's grads are read once, in chunks that span pieces."""
        self.coefficient = None
        # squares summed in fp64 where the grads are read (one copy to the host per step): any
        # chunking agrees
        local = torch.zeros((), dtype=torch.float64, device=self.files.store.device)
        for b in sorted({pc.buffer for pc in pieces}):
            spans = [
                Span(pc.shard_lo, pc.hi - pc.lo) for pc in pieces if pc.buffer == b and pc.counted
            ]
            for lo, hi, inside in chunk_spans(spans, self.chunk):
                g = self.read(b, lo, hi)
                for s in inside:
                    x, y = max(lo, s.start), min(hi, s.start + s.numel)
                    part = g[x - lo : y - lo]
                    local += torch.linalg.vector_norm(part, dtype=torch.float64).square()
        return all_reduce_over(local.float().to(device), groups).sqrt()

    def clip(self, norm: torch.Tensor, max_norm: float) -> None:
        """Later ``read``s multiply by the clip coefficient of ``norm``."""
        self.coefficient = clip_coefficient(norm, max_norm)

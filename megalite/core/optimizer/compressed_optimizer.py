"""The compressed optimizers (``compressed``: 1-bit Adam, 0/1 Adam, 1-bit LAMB) in the
mixed-precision family: masters, loss scaling, clipping and the fp16 skip as
``UnshardedOptimizer``, plus the one thing they need of the data-parallel wrapper.

Before each step's backward the wrapper must know whether to average the grads over DP: after
every step (and at construction, and after a load) this optimizer asks its inner one
(``full_grads_next``) and sets ``DistributedDataParallel.set_grad_reduce``. In a compressed or
local step the grads are the rank's own, so:

- the inf/NaN flag (fp16) is max-reduced over the DP groups too: every rank skips together;
- the grad norm and clipping are each rank's own (each worker clips its own gradient before it
  enters the momentum); the norm logged is that of the rank that logs.
"""

from __future__ import annotations

import logging

import torch

from megalite.core.distributed.data_parallel import DistributedDataParallel
from megalite.core.optimizer.compressed import PHASE_FULL, OneBitAdam, OneBitLamb, ZeroOneAdam
from megalite.core.optimizer.unsharded_optimizer import UnshardedOptimizer

logger = logging.getLogger(__name__)

CompressedInner = OneBitAdam | OneBitLamb | ZeroOneAdam


class CompressedOptimizer(UnshardedOptimizer):
    """``UnshardedOptimizer`` whose ``build_inner`` returns a compressed optimizer; ``model`` is
    the ``DistributedDataParallel`` wrapper whose grad reduction it switches (a bare module in a
    single-process run)."""

    optimizer: CompressedInner

    def __init__(self, param_groups: list[dict], build_inner, *, model, **kwargs):
        super().__init__(param_groups, build_inner, model=model, **kwargs)
        self.model = model
        self.dp_groups = (
            (model.dp_group, model.expert_dp_group)
            if isinstance(model, DistributedDataParallel)
            else (None, None)
        )
        self._sync_phase()

    def _sync_phase(self) -> None:
        if isinstance(self.model, DistributedDataParallel):
            self.model.set_grad_reduce(self.optimizer.full_grads_next())

    def _inf_groups(self) -> list:
        groups = super()._inf_groups()
        if self.optimizer.full_grads_next():
            return groups
        return [*groups, self.dp_groups[0], *(self.dp_groups[1:] if self.has_experts else ())]

    @torch.no_grad()
    def step(self):
        result = super().step()
        self._sync_phase()
        return result

    # --- what the logs read -----------------------------------------------------------------------

    @property
    def phase(self) -> int:
        """The last step's phase (``compressed.PHASE_*``: 0 full, 1 compressed, 2 local)."""
        return self.optimizer.last_phase

    def compression_error_norm(self) -> torch.Tensor:
        return self.optimizer.compressor.error_norm()

    def take_bytes_sent(self) -> int:
        """Bytes the compressed all-reduce sent since the last call (CommLog's convention)."""
        sent, self.optimizer.compressor.bytes_sent = self.optimizer.compressor.bytes_sent, 0
        return sent

    # --- checkpoints ------------------------------------------------------------------------------

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self._sync_phase()

    def full_state_dict(self, *, copy: bool = True) -> dict:
        sd = super().full_state_dict(copy=copy)
        sd["step"] = self.optimizer.step_count
        return sd

    @torch.no_grad()
    def load_full_state_dict(self, sd: dict) -> None:
        """The layout-independent state (another DP size): the moments and the step carry over;
        the error-feedback buffers belong to the old DP layout and restart from zero."""
        super().load_full_state_dict(sd)
        self.optimizer.step_count = int(sd["step"])
        self.optimizer.compressor.reset()
        if self.optimizer.phase_of(self.optimizer.step_count + 1) != PHASE_FULL:
            logger.warning(
                "compressed optimizer: the error-feedback buffers were re-initialised to zero "
                "(state loaded from another layout)"
            )
        self._sync_phase()

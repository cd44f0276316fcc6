"""The activations a training step keeps for backward, measured (the figure the planner's
activation term predicts).

``SavedTensorMeter`` counts the activations autograd keeps for backward with saved-tensor hooks:
every tensor a forward op saves is packed through it; its storage is counted once (views and
tensors saved by several ops share one storage) while any packed reference to it is alive, and
parameters are left out (they are model state, not activations). ``peak`` is the largest live
total seen, which is what the planner's activation term predicts for a training step.

Under the zero-bubble schedules (zb-h1, zbv, dualpipev) a linear layer's saved input is released
at I, like every saved tensor of that backward; the weight-grad queue then holds it (and the
output grad) until W, outside autograd: neither counted here nor in the planner's term. The hooks
leave the step's numbers bit-identical
(tests/core/pipeline_parallel/test_saved_tensor_hooks_wgrad.py).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterable

import torch

from megalite.core.optimizer.memory_report import ModelStateBytes, model_state_bytes
from megalite.training.model_chunks import grad_wrappers
from megalite.training.trainer import Trainer


class _Held:
    """What autograd keeps in place of a saved tensor while the meter is on."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class SavedTensorMeter:
    """``with SavedTensorMeter(params) as meter: <forward and backward>``; then ``meter.peak``
    (bytes). ``params``: tensors never counted (the model's parameters)."""

    def __init__(self, params: Iterable[torch.Tensor] = ()):
        # storages by identity (``_cdata``), not address: a ZeRO-3 unit's storage is resized
        # (released and re-gathered) and changes address while it stays the parameters'
        self.excluded = {p.untyped_storage()._cdata for p in params}
        self.live: dict[int, list[int]] = {}  # storage ptr -> [references, nbytes]
        self.current = 0
        self.peak = 0
        self.log: list[tuple[tuple[int, ...], torch.dtype, int, bool]] = []  # (shape, dtype, ...)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _release(self, ptr: int) -> None:
        entry = self.live[ptr]
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= entry[1]
            del self.live[ptr]

    def _pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if storage._cdata in self.excluded or storage.nbytes() == 0:
            return t
        held = _Held(t)
        entry = self.live.get(ptr)
        new = entry is None
        if new:
            entry = self.live[ptr] = [0, storage.nbytes()]
            self.current += entry[1]
            self.peak = max(self.peak, self.current)
        entry[0] += 1
        self.log.append((tuple(t.shape), t.dtype, storage.nbytes(), new))
        weakref.finalize(held, self._release, ptr)
        return held

    @staticmethod
    def _unpack(packed):
        return packed.tensor if isinstance(packed, _Held) else packed

    def __enter__(self) -> SavedTensorMeter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def measure_step(
    trainer: Trainer, forward_step_func: Callable, data_iterator
) -> tuple[ModelStateBytes, int, float]:
    """Run one training step of ``trainer`` under a ``SavedTensorMeter``: (model-state bytes as
    ``memory_report`` measures them before the step, saved-activation peak in bytes, step
    seconds)."""
    wrapper = grad_wrappers(trainer.model)[0]  # the chunks of a rank share one
    params = list(wrapper.parameters())
    state = model_state_bytes(wrapper, trainer.optimizer, dp_size=trainer.ps.dp_size)
    start = time.perf_counter()
    with SavedTensorMeter(params) as meter:
        trainer.step(forward_step_func, data_iterator)
    return state, meter.peak, time.perf_counter() - start

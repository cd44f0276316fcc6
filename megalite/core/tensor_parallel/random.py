"""RNG states for tensor-parallel dropout, and activation recomputation that replays them.

Two streams per rank:
- the default generator (torch's global CPU generator, or the CUDA one on GPU), seeded
  ``seed + 100 * pp_rank``: identical across TP and DP ranks. Dropout outside TP regions (on the
  full hidden state, or on a sequence-parallel shard) draws from it.
- the tracker's ``"tensor-parallel"`` state, seeded ``seed + 2718 + 100 * pp_rank + tp_rank``:
  different across TP ranks, identical across DP ranks. Dropout on TP-sharded activations (attention
  probabilities of this rank's heads) runs inside ``tracker.fork()``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

TP_RNG = "tensor-parallel"


def _get_state(device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def _set_state(state: torch.Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class RNGStatesTracker:
    """Named RNG states that can be swapped in for a region of code (``with tracker.fork():``)."""

    def __init__(self, device: torch.device | None = None):
        self.device = device or torch.device("cpu")
        self._states: dict[str, torch.Tensor] = {}

    def add(self, name: str, seed: int) -> None:
        if name in self._states:
            raise ValueError(f"RNG state {name!r} already exists")
        saved = _get_state(self.device)
        if self.device.type == "cuda":
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)
        self._states[name] = _get_state(self.device)
        _set_state(saved, self.device)

    @contextlib.contextmanager
    def fork(self, name: str = TP_RNG) -> Iterator[None]:
        """Run the block with the named state as the default generator; keep what it consumed."""
        if name not in self._states:
            raise KeyError(f"RNG state {name!r} was never added (known: {sorted(self._states)})")
        saved = _get_state(self.device)
        _set_state(self._states[name], self.device)
        try:
            yield
        finally:
            self._states[name] = _get_state(self.device)
            _set_state(saved, self.device)

    def get_states(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self._states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._states = {k: v.clone() for k, v in states.items()}


def model_parallel_seed(
    seed: int, *, tp_rank: int, pp_rank: int, device: torch.device | None = None
) -> RNGStatesTracker:
    """Seed the default generator (same on all TP/DP ranks of a stage) and return a tracker whose
    tensor-parallel state differs across TP ranks and agrees across DP ranks."""
    device = device or torch.device("cpu")
    base = seed + 100 * pp_rank
    torch.manual_seed(base)
    tracker = RNGStatesTracker(device)
    tracker.add(TP_RNG, base + 2718 + tp_rank)
    return tracker


class _Recompute(torch.autograd.Function):
    """Forward without keeping activations; backward re-runs forward under the same RNG states."""

    @staticmethod
    def forward(ctx, function, tracker, device, *args):
        ctx.function, ctx.tracker, ctx.device = function, tracker, device
        ctx.rng_state = _get_state(device)
        ctx.tracker_states = tracker.get_states() if tracker is not None else None
        ctx.cpu_state = torch.get_rng_state() if device.type == "cuda" else None
        with torch.no_grad():
            outputs = function(*args)
        ctx.save_for_backward(*(a if torch.is_tensor(a) else None for a in args))
        ctx.non_tensor = [None if torch.is_tensor(a) else a for a in args]
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        saved = ctx.saved_tensors
        args = [
            t.detach().requires_grad_(t.requires_grad) if t is not None else ctx.non_tensor[i]
            for i, t in enumerate(saved)
        ]
        # swap in the forward's RNG states, recompute, then put the current ones back
        now_state = _get_state(ctx.device)
        now_tracker = ctx.tracker.get_states() if ctx.tracker is not None else None
        now_cpu = torch.get_rng_state() if ctx.cpu_state is not None else None
        _set_state(ctx.rng_state, ctx.device)
        if ctx.tracker is not None:
            ctx.tracker.set_states(ctx.tracker_states)
        if ctx.cpu_state is not None:
            torch.set_rng_state(ctx.cpu_state)
        try:
            with torch.enable_grad():
                outputs = ctx.function(*args)
        finally:
            _set_state(now_state, ctx.device)
            if ctx.tracker is not None:
                ctx.tracker.set_states(now_tracker)
            if now_cpu is not None:
                torch.set_rng_state(now_cpu)
        if torch.is_tensor(outputs):
            outputs = (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads) if torch.is_tensor(o) and o.requires_grad]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        arg_grads = tuple(a.grad if torch.is_tensor(a) else None for a in args)
        return (None, None, None, *arg_grads)


def checkpoint(function, *args, tracker: RNGStatesTracker | None, device: torch.device):
    """``function(*args)`` without storing its activations; recomputed in backward with the RNG
    states (default and tracker) it saw in forward, so dropout masks are replayed exactly."""
    return _Recompute.apply(function, tracker, device, *args)

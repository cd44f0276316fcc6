"""``--exit-signal-handler``: save and exit cleanly when the scheduler asks the job to stop.

A cluster stops a job with a signal: SLURM sends SIGTERM on preemption, cancellation and at the
time limit (then SIGKILL after ``KillWait``/``GraceTime``), and ``sbatch --signal=USR1@120`` sends
the signal it names ahead of the limit. The contract, per rank:

1. ``ExitSignalHandler.install()`` replaces the signal's action with a handler that only sets a
   flag (nothing else is safe inside a Python signal handler: it may run in the middle of a
   collective's Python wrapper or of a logging call).
2. At every iteration boundary every rank calls ``any_rank_signalled`` — one all-reduce (MAX) of
   its flag over the world — so all ranks agree at the same iteration even when the signal reached
   one rank only (a launcher forwarding it to one child, a ``kill`` by hand).
3. When any rank got it, the loop saves a checkpoint and returns; the process exits 0, and the batch
   script requeues the job, which resumes from ``--save``.

The flag is sticky: a second signal (torchrun forwarding the one SLURM already delivered) changes
nothing. ``restore()`` puts the previous action back. A rank that dies instead ends the job through
the launcher and the failing collectives of its peers; no checkpoint is written for that iteration.
"""

from __future__ import annotations

import logging
import signal
from types import FrameType

import torch
import torch.distributed as dist

from megalite.core.groups import group_size

logger = logging.getLogger(__name__)

DEFAULT_EXIT_SIGNAL = signal.SIGTERM
_UNCATCHABLE = {signal.SIGKILL, signal.SIGSTOP}


def parse_signal(text: str) -> signal.Signals:
    """``"SIGUSR1"``, ``"USR1"``, ``"usr1"`` or ``"10"`` -> ``signal.SIGUSR1``; ValueError otherwise
    (unknown names, and SIGKILL / SIGSTOP, which no process can catch)."""
    name = text.strip().upper()
    try:
        sig = (
            signal.Signals(int(name))
            if name.isdigit()
            else signal.Signals[name if name.startswith("SIG") else "SIG" + name]
        )
    except (KeyError, ValueError):
        raise ValueError(
            f"exit_signal {text!r} is not a signal; use a name such as SIGTERM or SIGUSR1"
        ) from None
    if sig in _UNCATCHABLE:
        raise ValueError(f"exit_signal {sig.name} cannot be caught; use SIGTERM or SIGUSR1")
    return sig


class ExitSignalHandler:
    """Set a flag when ``signum`` arrives; see the module docstring for the contract.

    Install from the main thread (Python delivers signals there only). Usable as a context manager:
    ``with ExitSignalHandler(signal.SIGTERM) as handler: ...`` restores the old action on exit.
    """

    def __init__(self, signum: signal.Signals = DEFAULT_EXIT_SIGNAL):
        self.signum = signal.Signals(signum)
        self.received = False
        self._previous = None
        self._installed = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = True  # only this: see the module docstring

    def install(self) -> ExitSignalHandler:
        if not self._installed:
            self._previous = signal.signal(self.signum, self._handle)
            self._installed = True
        return self

    def restore(self) -> None:
        if self._installed:
            signal.signal(self.signum, self._previous)
            self._installed = False

    def __enter__(self) -> ExitSignalHandler:
        return self.install()

    def __exit__(self, *exc) -> None:
        self.restore()


def any_rank_signalled(received: bool, *, group, device: torch.device) -> bool:
    """Whether any rank of ``group`` (pass the world group: ``ps.group()``) has ``received`` True.

    A collective: every rank of the group must call it at the same point (the iteration boundary).
    One all-reduce of one element; a world of one (or no process group) answers at once.
    """
    if group_size(group) == 1:
        return received
    flag = torch.tensor([1.0 if received else 0.0], dtype=torch.float32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item() > 0.0)

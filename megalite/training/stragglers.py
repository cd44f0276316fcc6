"""Slow ranks (``--log-straggler``): each rank's compute and communication time per step, gathered
at the log interval; the ranks whose compute time exceeds ``straggler_slowdown`` x the median are
named in the log line and in TensorBoard.

    meter = StragglerMeter(rank=r, world_group=ps.group())     # turns the op recorder on
    meter.begin_step(); trainer.step(...); meter.end_step()
    report = meter.gather()            # every rank calls it at the log interval (one all-gather)
    report.line(coords), report.scalars()

Communication time is the time the main thread waited on recorded collectives and messages (the
op recorder's ``comm_wait_s``); compute time is the rest of the step's wall time. Both are host
times: on CUDA a kernel's time shows where the host waits for it (a p2p or collective wait, the
loss read), which is where a slow GPU makes the others wait too. A slow rank makes its peers
wait, so their communication time grows and their compute stays; hence the compute time names it.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from megalite.core.groups import all_gather_tensor, group_size
from megalite.core.op_record import RECORDER


@dataclass
class StragglerReport:
    """Per-rank seconds per step over one log interval, and what they say."""

    compute_s: list[float]
    comm_s: list[float]
    slowdown: float
    minmax_count: int

    @property
    def median_s(self) -> float:
        return statistics.median(self.compute_s)

    def slow_ranks(self) -> list[int]:
        """The ranks whose compute time exceeds ``slowdown`` x the median, slowest first."""
        median = self.median_s
        slow = [r for r, t in enumerate(self.compute_s) if t > self.slowdown * median]
        return sorted(slow, key=lambda r: -self.compute_s[r])

    def line(self, coords: list[str] | None = None) -> str:
        """The log line: the slow ranks (or none), then the slowest and fastest ranks."""
        where = coords or [""] * len(self.compute_s)
        median = self.median_s
        order = sorted(range(len(self.compute_s)), key=lambda r: -self.compute_s[r])
        n = min(self.minmax_count, len(order))

        def one(r: int) -> str:
            return (
                f"rank {r}{where[r]} {self.compute_s[r]:.3f}/{self.comm_s[r]:.3f} s"
                f" ({self.compute_s[r] / median:.2f}x)"
                if median > 0
                else f"rank {r}{where[r]} {self.compute_s[r]:.3f}/{self.comm_s[r]:.3f} s"
            )

        slow = self.slow_ranks()
        head = (
            "slow ranks: " + ", ".join(one(r) for r in slow)
            if slow
            else f"slow ranks: none over {self.slowdown:g}x the median"
        )
        return (
            f"{head} | compute/comm per step, median compute {median:.3f} s | slowest "
            + ", ".join(one(r) for r in order[:n])
            + " | fastest "
            + ", ".join(one(r) for r in order[::-1][:n])
        )

    def scalars(self) -> dict[str, float]:
        """TensorBoard: the slowest rank, its ratio to the median, how many ranks are slow."""
        slowest = max(range(len(self.compute_s)), key=lambda r: self.compute_s[r])
        median = self.median_s
        return {
            "stragglers/slowest-rank": float(slowest),
            "stragglers/slowest-over-median": self.compute_s[slowest] / median if median else 0.0,
            "stragglers/slow-ranks": float(len(self.slow_ranks())),
        }


class StragglerMeter:
    """This rank's step times since the last ``gather``. Turns the op recorder on (its ``close``
    turns it off again if it was off)."""

    def __init__(self, *, rank: int, world_group, slowdown: float = 1.5, minmax_count: int = 1):
        self.world_group, self.slowdown, self.minmax_count = world_group, slowdown, minmax_count
        self._owns_recorder = not RECORDER.enabled
        if self._owns_recorder:
            RECORDER.enable(rank=rank)
        self.steps, self.wall_s, self.comm_s = 0, 0.0, 0.0
        self._t0 = self._comm0 = 0.0

    def begin_step(self) -> None:
        self._t0, self._comm0 = time.perf_counter(), RECORDER.comm_wait_s

    def end_step(self) -> None:
        self.steps += 1
        self.wall_s += time.perf_counter() - self._t0
        self.comm_s += RECORDER.comm_wait_s - self._comm0

    def gather(self) -> StragglerReport:
        """Every rank's averages since the last call (a collective over ``world_group``)."""
        n = max(self.steps, 1)
        mine = torch.tensor([(self.wall_s - self.comm_s) / n, self.comm_s / n], dtype=torch.float64)
        every = torch.zeros(group_size(self.world_group), 2, dtype=torch.float64)
        if len(every) > 1:
            all_gather_tensor(every, mine.reshape(1, 2), self.world_group, what="step times")
        else:
            every[0] = mine
        self.steps, self.wall_s, self.comm_s = 0, 0.0, 0.0
        return StragglerReport(
            compute_s=every[:, 0].tolist(),
            comm_s=every[:, 1].tolist(),
            slowdown=self.slowdown,
            minmax_count=self.minmax_count,
        )

    def close(self) -> None:
        if self._owns_recorder:
            RECORDER.disable()

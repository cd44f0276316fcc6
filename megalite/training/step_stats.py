"""What the loop keeps between log lines, on the device: losses, counters and the NaN/inf watch.

A training step reads nothing back from the device (DESIGN §7): every per-step number (loss sums,
skipped and non-finite iterations, the first iteration whose loss or grad norm was not finite)
is accumulated here as a tensor, and read once per log interval, before a checkpoint is written
and at the end of the run (``read``). A non-finite loss or grad norm is therefore noticed at the
next such point, up to ``--log-interval`` iterations late; it is never saved into a checkpoint,
because ``check`` runs before every save.

    stats = DeviceStats(device)
    stats.add(iteration, losses, grad_norm, update_successful)    # every step, no host sync
    snapshot = stats.read(ps.group(), ps.group("pp"))              # log interval: one sync
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megalite.core.groups import group_size

NOT_SEEN = math.inf  # "no non-finite value yet" in the first-bad-iteration slots


@dataclass
class IntervalSnapshot:
    """Host copies at a read: the mean of each loss over the interval's finite steps, counts, and
    the first iterations (whole run, every rank) whose loss / grad norm was not finite."""

    losses: dict[str, float]
    iterations: int
    skipped: int
    nonfinite: int
    first_bad_loss: int | None
    first_bad_grad_norm: int | None
    per_step_losses: list[float]  # "lm loss" of every step since the last read (last stage)
    per_step_grad_norms: list[float]  # NaN for skipped steps
    num_zeros_in_grad: float | None = None  # the last step's count (when counted)


class DeviceStats:
    """Device-side sums since the last ``read``; see the module docstring."""

    def __init__(self, device: torch.device):
        self.device = device
        self._nan = torch.full((), math.nan, dtype=torch.float64, device=device)  # skipped steps
        # first iteration with a non-finite [loss, grad norm] on this rank, for the whole run
        self.first_bad = torch.full((2,), NOT_SEEN, dtype=torch.float64, device=device)
        self._reset()

    def _reset(self) -> None:
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        self.loss_sums: dict[str, torch.Tensor] = {}
        self.finite_steps = zero.clone()
        self.nonfinite = zero.clone()
        self.iterations, self.skipped = 0, 0
        self.step_losses: list[torch.Tensor] = []
        self.step_grad_norms: list[torch.Tensor] = []
        self.last_num_zeros: torch.Tensor | None = None  # --log-num-zeros-in-grad

    def add(
        self,
        iteration: int,
        losses: dict[str, torch.Tensor],
        grad_norm: torch.Tensor | None,
        update_successful: bool,
        num_zeros_in_grad: torch.Tensor | None = None,
    ) -> None:
        """Account one step (no host sync). ``losses``: 0-d tensors on the last stage, {} else;
        ``grad_norm`` None when the step was skipped (fp16 overflow); ``num_zeros_in_grad``
        (``--log-num-zeros-in-grad``) kept for the next read."""
        self.iterations += 1
        if num_zeros_in_grad is not None:
            self.last_num_zeros = num_zeros_in_grad.detach().to(self.device, torch.float64)
        if not update_successful:
            self.skipped += 1
        if losses:
            values = torch.stack(
                [v.detach().to(self.device, torch.float64) for v in losses.values()]
            )
            finite = torch.isfinite(values).all()
            if update_successful:  # a skipped step's loss is not averaged (Megatron's habit)
                for name, value in zip(losses, values.unbind(0)):
                    kept = torch.where(finite, value, torch.zeros_like(value))
                    self.loss_sums[name] = self.loss_sums.get(name, 0.0) + kept
                self.finite_steps += finite.to(torch.float64)
            self.nonfinite += (~finite).to(torch.float64)
            if update_successful:
                self._mark(0, ~finite, iteration)
            lm = losses.get("lm loss")
            self.step_losses.append(
                self._nan if lm is None else lm.detach().to(self.device, torch.float64)
            )
        if grad_norm is None:
            self.step_grad_norms.append(self._nan)
        else:
            norm = grad_norm.detach().to(self.device, torch.float64).reshape(())
            self._mark(1, ~torch.isfinite(norm), iteration)
            self.step_grad_norms.append(norm)

    def _mark(self, slot: int, bad: torch.Tensor, iteration: int) -> None:
        first = self.first_bad[slot]
        take = bad & torch.isinf(first)
        self.first_bad[slot] = torch.where(take, torch.full_like(first, float(iteration)), first)

    def read(self, world_group) -> IntervalSnapshot:
        """Host copies of everything since the last read, then reset the interval. Collective
        over ``world_group`` (the first non-finite iterations are min-reduced so every rank stops
        at the same point): call it at the same iteration on every rank."""
        first_bad = self.first_bad.clone()
        if group_size(world_group) > 1:
            dist.all_reduce(first_bad, op=dist.ReduceOp.MIN, group=world_group)
        names = list(self.loss_sums)
        packed = torch.cat(
            [
                torch.stack([self.loss_sums[n] for n in names]) if names else first_bad[:0],
                torch.stack([self.finite_steps, self.nonfinite]),
                first_bad,
                torch.stack(self.step_losses) if self.step_losses else first_bad[:0],
                torch.stack(self.step_grad_norms) if self.step_grad_norms else first_bad[:0],
                first_bad[:0] if self.last_num_zeros is None else self.last_num_zeros.reshape(1),
            ]
        ).tolist()  # the one device -> host copy of the interval
        k, n_loss = len(names), len(self.step_losses)
        sums, (finite_steps, nonfinite), (bad_loss, bad_norm) = (
            packed[:k],
            packed[k : k + 2],
            packed[k + 2 : k + 4],
        )
        rest = packed[k + 4 :]
        snapshot = IntervalSnapshot(
            losses={n: s / max(finite_steps, 1.0) for n, s in zip(names, sums)},
            iterations=self.iterations,
            skipped=self.skipped,
            nonfinite=int(nonfinite),
            first_bad_loss=None if math.isinf(bad_loss) else int(bad_loss),
            first_bad_grad_norm=None if math.isinf(bad_norm) else int(bad_norm),
            per_step_losses=rest[:n_loss],
            per_step_grad_norms=rest[n_loss : n_loss + len(self.step_grad_norms)],
            num_zeros_in_grad=None if self.last_num_zeros is None else rest[-1],
        )
        self._reset()
        return snapshot

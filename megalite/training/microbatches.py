"""The global batch size per iteration: constant, a ramp, or a step schedule (Megatron's
micro-batch calculators).

    bs = BatchSizeCalculator(global_batch_size=1024, micro_batch_size=2, dp_size=8,
                       rampup=(16, 16, 300000))
    bs.global_batch_size(consumed_samples)   # the batch of the iteration starting there
    bs.num_microbatches(consumed_samples)    # per DP rank: that batch / (micro x DP)
    bs.train_iters(train_samples)            # iterations a --train-samples run takes

``--rampup-batch-size START INCREMENT SAMPLES`` with ``--global-batch-size G``: the batch grows
from START by INCREMENT, ``(G - START) / INCREMENT`` times, each after ``SAMPLES / increments``
consumed samples (a float); past SAMPLES it is G:

    consumed > SAMPLES   batch = G
    otherwise            batch = START + INCREMENT * int(consumed / (SAMPLES / increments))

``--step-batch-size-schedule "T0:B0 T1:B1 ..."``: from ``Ti`` consumed *tokens* on (``Ti //
seq_length`` samples; K/M/B/T suffixes = 1e3/1e6/1e9/1e12; T0 = 0) the batch is ``Bi``; the last
``Bi`` is the run's global batch size. The batch is decided at the start of each iteration from the
samples consumed before it, so a run resumed from a checkpoint mid-ramp continues with the same
sizes. Every batch must be whole micro-batches on every DP rank (checked once, for all of them).
With a schedule the iteration count of ``--train-samples N`` is counted as Megatron counts it:
ramp iterations while consumed <= SAMPLES (and <= N), then ``(N - consumed) // G``.
"""

from __future__ import annotations

from megalite.errors import ConfigError

_SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


def parse_count(text: str) -> int:
    """``"250B"`` -> 250_000_000_000 (suffixes K, M, B, T; a float before one is allowed)."""
    t = text.strip().upper()
    scale = _SUFFIXES.get(t[-1:], 1)
    if scale > 1:
        t = t[:-1]
    try:
        return int(float(t) * scale)
    except ValueError:
        raise ConfigError(
            f"--step-batch-size-schedule: {text!r} is not a number (suffixes K, M, B, T)"
        ) from None


def parse_step_schedule(text: str, *, seq_length: int) -> list[tuple[int, int]]:
    """``"0:768 250B:1536"`` (tokens) -> ``[(0, 768), (250e9 // seq_length, 1536)]`` (samples),
    sorted; one-line ConfigError for a malformed entry, a first threshold other than 0, repeated
    thresholds or a batch < 1."""
    entries = []
    for entry in text.replace(",", " ").split():
        if ":" not in entry:
            raise ConfigError(
                f"--step-batch-size-schedule: entry {entry!r} is not THRESHOLD:BATCH_SIZE "
                "(e.g. '0:256 1B:512')"
            )
        threshold, batch = entry.split(":", 1)
        entries.append((parse_count(threshold) // seq_length, parse_count(batch)))
    entries.sort()
    if not entries or entries[0][0] != 0:
        raise ConfigError(
            f"--step-batch-size-schedule {text!r}: the first threshold must be 0 (the batch size "
            "the run starts with)"
        )
    for (t0, _), (t1, _) in zip(entries, entries[1:]):
        if t1 <= t0:
            raise ConfigError(
                f"--step-batch-size-schedule {text!r}: thresholds must increase (two fall on "
                f"sample {t0} at --seq-length {seq_length})"
            )
    bad = [b for _, b in entries if b < 1]
    if bad:
        raise ConfigError(f"--step-batch-size-schedule {text!r}: batch size {bad[0]} is < 1")
    return entries


class BatchSizeCalculator:
    """Megatron's micro-batch calculator (constant, ramp-up or step schedule); see the module
    docstring. ``rampup``: (start, increment, samples); ``steps``: ``parse_step_schedule``'s
    list. Raises a one-line ConfigError naming the flag on any batch that is not whole
    micro-batches on every DP rank."""

    def __init__(
        self,
        *,
        global_batch_size: int,
        micro_batch_size: int,
        dp_size: int,
        rampup: tuple[int, int, int] | None = None,
        steps: list[tuple[int, int]] | None = None,
    ):
        if rampup is not None and steps is not None:
            raise ConfigError(
                "--rampup-batch-size and --step-batch-size-schedule are mutually exclusive"
            )
        self.final = global_batch_size
        self.per_micro_step = micro_batch_size * dp_size  # samples of one micro-step over DP
        self.rampup, self.steps = rampup, steps
        sizes = [global_batch_size]
        flag = "--global-batch-size"
        if rampup is not None:
            flag = "--rampup-batch-size"
            start, increment, samples = (int(v) for v in rampup)
            if start < 1 or increment < 1 or samples < 0:
                raise ConfigError(
                    f"--rampup-batch-size {start} {increment} {samples}: need start >= 1, "
                    "increment >= 1 and ramp samples >= 0"
                )
            diff = global_batch_size - start
            if diff < 0 or diff % increment:
                raise ConfigError(
                    f"--rampup-batch-size: --global-batch-size {global_batch_size} minus the "
                    f"start {start} = {diff} must be a non-negative multiple of the increment "
                    f"{increment}"
                )
            self.increments = diff // increment
            self.samples_per_increment = samples / self.increments if self.increments else 0.0
            sizes = [start + k * increment for k in range(self.increments + 1)]
        if steps is not None:
            flag = "--step-batch-size-schedule"
            self.final = steps[-1][1]
            sizes = [b for _, b in steps]
        for size in sizes:
            if size % self.per_micro_step:
                raise ConfigError(
                    f"{flag}: batch size {size} is not a multiple of --micro-batch-size "
                    f"{micro_batch_size} x data-parallel size {dp_size} = {self.per_micro_step}; "
                    "choose sizes (start and increment) that are"
                )

    @property
    def constant(self) -> bool:
        return self.rampup is None and self.steps is None

    def global_batch_size(self, consumed_samples: int) -> int:
        """The global batch of the iteration that starts after ``consumed_samples``."""
        if self.steps is not None:
            size = self.steps[0][1]
            for threshold, batch in self.steps:
                if consumed_samples >= threshold:
                    size = batch
            return size
        if self.rampup is None or not self.increments or consumed_samples > self.rampup[2]:
            return self.final
        if not self.samples_per_increment:  # a ramp of 0 samples: the start, then G
            return self.rampup[0] if consumed_samples == 0 else self.final
        done = int(consumed_samples / self.samples_per_increment)
        return min(self.final, self.rampup[0] + done * self.rampup[1])

    def num_microbatches(self, consumed_samples: int) -> int:
        """Micro-batches per DP rank in the iteration that starts after ``consumed_samples``."""
        return self.global_batch_size(consumed_samples) // self.per_micro_step

    def train_iters(self, train_samples: int) -> int:
        """Iterations a ``--train-samples`` run takes (Megatron's ``update_train_iters``)."""
        if self.constant:
            return train_samples // self.final
        iterations = consumed = 0
        if self.steps is not None:
            while consumed < train_samples:
                consumed += self.global_batch_size(consumed)
                iterations += 1
            return iterations
        while consumed <= self.rampup[2] and consumed <= train_samples:  # the ramp
            consumed += self.global_batch_size(consumed)
            iterations += 1
        if train_samples > consumed:  # then constant; a partial last batch is dropped
            iterations += (train_samples - consumed) // self.final
        return iterations

    def consumed_after(self, iterations: int) -> int:
        """Samples consumed by the first ``iterations`` iterations."""
        consumed = 0
        for _ in range(iterations):
            consumed += self.global_batch_size(consumed)
        return consumed


def batch_size_calculator(training, dp_size: int, *, seq_length: int) -> BatchSizeCalculator:
    """The ``BatchSizeCalculator`` of a ``TrainingConfig`` on a mesh of ``dp_size`` DP ranks."""
    steps = None
    if training.step_batch_size_schedule is not None:
        steps = parse_step_schedule(training.step_batch_size_schedule, seq_length=seq_length)
    rampup = training.rampup_batch_size
    return BatchSizeCalculator(
        global_batch_size=training.global_batch_size,
        micro_batch_size=training.micro_batch_size,
        dp_size=dp_size,
        rampup=None if rampup is None else tuple(rampup),
        steps=steps,
    )

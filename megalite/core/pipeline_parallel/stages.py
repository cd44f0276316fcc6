"""Which layers each pipeline stage holds.

Even split: ``num_layers / pp_size`` per stage. Uneven (Megatron's
``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers``): the first and/or
last stage take the given counts and the stages between share the rest evenly. Ranges are global
``[start, end)`` layer numbers.
"""

from __future__ import annotations


def stage_layer_ranges(
    num_layers: int,
    pp_size: int,
    *,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
) -> list[tuple[int, int]]:
    """The ``[start, end)`` of every stage, in stage order; one-line ValueError if impossible."""
    if pp_size < 1 or num_layers < 1:
        raise ValueError(f"need --num-layers >= 1 and PP >= 1, got {num_layers} and {pp_size}")
    counts: list[int | None] = [None] * pp_size
    for flag, value, index in (
        ("--decoder-first-pipeline-num-layers", first_stage_layers, 0),
        ("--decoder-last-pipeline-num-layers", last_stage_layers, pp_size - 1),
    ):
        if value is None:
            continue
        if pp_size == 1:
            raise ValueError(f"{flag} needs --pipeline-model-parallel-size > 1")
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
        counts[index] = value
    fixed = sum(c for c in counts if c is not None)
    free = [i for i, c in enumerate(counts) if c is None]
    rest = num_layers - fixed
    if free:
        if fixed == 0 and num_layers % pp_size:
            raise ValueError(
                f"--num-layers {num_layers} is not divisible by --pipeline-model-parallel-size "
                f"{pp_size}; each stage must hold the same number of layers (or set "
                "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers)"
            )
        if rest < len(free) or rest % len(free):
            raise ValueError(
                f"--num-layers {num_layers} minus the first/last stage layers ({fixed}) leaves "
                f"{rest}, which does not split evenly over the other {len(free)} pipeline "
                f"stage(s); change --num-layers, --pipeline-model-parallel-size or the "
                "first/last stage layer counts"
            )
        for i in free:
            counts[i] = rest // len(free)
    elif rest != 0:
        raise ValueError(
            f"--decoder-first-pipeline-num-layers + --decoder-last-pipeline-num-layers = {fixed} "
            f"but --num-layers is {num_layers} with PP {pp_size}"
        )
    ranges, start = [], 0
    for c in counts:
        ranges.append((start, start + c))
        start += c
    return ranges

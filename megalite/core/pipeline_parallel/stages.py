"""Which layers each pipeline rank holds, and in which model chunks.

Even split: ``num_layers / pp_size`` per rank. Uneven (Megatron's first/last pipeline stage layer
counts): the first and/or last rank take ``first_stage_layers`` / ``last_stage_layers`` and the
ranks between share the rest evenly. Ranges are global ``[start, end)`` layer numbers.

With ``v = num_virtual_stages`` > 1 (interleaved pipeline) every rank holds ``v`` model chunks and
its layer count is cut into ``v`` blocks, equal when they divide (Megatron requires that). When
they do not (Llama 3 405B: 126 layers over 16 stages, the first and last holding 7), the earlier
chunks take one layer more (7 over 4 chunks: 2, 2, 2, 1; the last rank's last chunk, which also
holds the output layer and the loss, is the lighter one); every chunk needs a layer. The layers are
dealt out in ``v`` rounds, as Megatron does: round ``c`` gives every rank, in rank order, its
``c``-th block, so chunk ``c`` of rank ``r`` holds the ``(c * pp_size + r)``-th block of layers.
E.g. 8 layers, pp 2, v 2: rank 0 holds [0, 2) and [4, 6), rank 1 holds [2, 4) and [6, 8).
"""

from __future__ import annotations


def _rank_layer_counts(
    num_layers: int, pp_size: int, first: int | None, last: int | None
) -> list[int]:
    """How many layers each pipeline rank holds in total (all of its chunks)."""
    counts: list[int | None] = [None] * pp_size
    for name, value, index in (
        ("first_stage_layers", first, 0),
        ("last_stage_layers", last, pp_size - 1),
    ):
        if value is None:
            continue
        if pp_size == 1:
            raise ValueError(f"{name} needs pp_size > 1: one stage is both the first and the last")
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
        counts[index] = value
    fixed = sum(c for c in counts if c is not None)
    free = [i for i, c in enumerate(counts) if c is None]
    rest = num_layers - fixed
    if free:
        if fixed == 0 and num_layers % pp_size:
            raise ValueError(
                f"num_layers {num_layers} is not divisible by pp_size {pp_size}; each stage "
                "must hold the same number of layers (or set first_stage_layers / "
                "last_stage_layers)"
            )
        if rest < len(free) or rest % len(free):
            raise ValueError(
                f"num_layers {num_layers} minus the first/last stage layers ({fixed}) leaves "
                f"{rest}, which does not split evenly over the other {len(free)} pipeline "
                "stage(s); change num_layers, pp_size or first_stage_layers / last_stage_layers"
            )
        for i in free:
            counts[i] = rest // len(free)
    elif rest != 0:
        raise ValueError(
            f"first_stage_layers + last_stage_layers = {fixed} but num_layers is {num_layers} "
            f"with pp_size {pp_size}; they must add up to num_layers"
        )
    return [int(c) for c in counts]


def stage_layer_ranges(
    num_layers: int,
    pp_size: int,
    *,
    num_virtual_stages: int = 1,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
) -> list[tuple[int, int]] | list[list[tuple[int, int]]]:
    """Per pipeline rank, in rank order: its ``[start, end)`` layers when ``num_virtual_stages``
    is 1, else the list of its chunks' ``[start, end)`` ranges, chunk 0 first (see the module
    docstring; ``chunk_layer_ranges`` always returns the nested form). One-line ValueError,
    naming the numbers, when the layers do not divide."""
    chunks = chunk_layer_ranges(
        num_layers,
        pp_size,
        num_virtual_stages=num_virtual_stages,
        first_stage_layers=first_stage_layers,
        last_stage_layers=last_stage_layers,
    )
    if num_virtual_stages == 1:
        return [rank_chunks[0] for rank_chunks in chunks]
    return chunks


def chunk_layer_ranges(
    num_layers: int,
    pp_size: int,
    *,
    num_virtual_stages: int = 1,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
) -> list[list[tuple[int, int]]]:
    """``ranges[r][c]``: the ``[start, end)`` layers of chunk ``c`` of pipeline rank ``r``."""
    v = num_virtual_stages
    if pp_size < 1 or num_layers < 1 or v < 1:
        raise ValueError(
            f"need num_layers >= 1, pp_size >= 1 and num_virtual_stages >= 1, got {num_layers}, "
            f"{pp_size} and {v}"
        )
    counts = _rank_layer_counts(num_layers, pp_size, first_stage_layers, last_stage_layers)
    for rank, count in enumerate(counts):
        if count < v:
            raise ValueError(
                f"pipeline rank {rank} holds {count} layers, fewer than num_virtual_stages {v}: "
                "every chunk needs a layer; change num_layers, pp_size, num_virtual_stages or "
                "first_stage_layers / last_stage_layers"
            )
    ranges: list[list[tuple[int, int]]] = [[] for _ in range(pp_size)]
    start = 0
    for c in range(v):  # round c deals every rank its c-th block, in rank order
        for rank, count in enumerate(counts):
            size = count // v + (c < count % v)  # uneven: the earlier chunks one layer more
            ranges[rank].append((start, start + size))
            start += size
    return ranges

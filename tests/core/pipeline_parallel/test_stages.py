"""Which layers each pipeline rank holds: even, uneven (first/last stage counts), and in virtual
stages (chunk c of rank r holds the (c * pp + r)-th block of layers, as Megatron assigns them).
Errors name the parameters and the numbers, on one line."""

from __future__ import annotations

import pytest

from megalite.core.pipeline_parallel.stages import chunk_layer_ranges, stage_layer_ranges


def test_one_chunk_per_rank():
    assert stage_layer_ranges(8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert stage_layer_ranges(5, 2, first_stage_layers=2) == [(0, 2), (2, 5)]
    uneven = [(0, 1), (1, 4), (4, 7), (7, 10)]
    assert stage_layer_ranges(10, 4, first_stage_layers=1, last_stage_layers=3) == uneven
    assert stage_layer_ranges(8, 4, num_virtual_stages=1) == stage_layer_ranges(8, 4)
    assert chunk_layer_ranges(8, 2) == [[(0, 4)], [(4, 8)]]


# (num_layers, pp, v, first, last, ranges[rank] = [chunk 0, chunk 1, ...]), written by hand
# 22 layers over 3 ranks, first and last holding 7, v 4: a rank's chunks, chunk 0 first
LLAMA_405B_IN_SMALL = [
    [(0, 2), (6, 8), (12, 14), (18, 19)],
    [(2, 4), (8, 10), (14, 16), (19, 21)],
    [(4, 6), (10, 12), (16, 18), (21, 22)],
]
VIRTUAL = [
    (8, 2, 2, None, None, [[(0, 2), (4, 6)], [(2, 4), (6, 8)]]),
    (8, 4, 2, None, None, [[(0, 1), (4, 5)], [(1, 2), (5, 6)], [(2, 3), (6, 7)], [(3, 4), (7, 8)]]),
    (12, 2, 3, None, None, [[(0, 2), (4, 6), (8, 10)], [(2, 4), (6, 8), (10, 12)]]),
    (16, 2, 2, None, None, [[(0, 4), (8, 12)], [(4, 8), (12, 16)]]),
    (4, 1, 2, None, None, [[(0, 2), (2, 4)]]),
    # uneven: per virtual round, rank 0 gets first/v, the middle ranks share the rest, last gets
    # last/v (Megatron's offsets for num_layers_in_first/last_pipeline_stage with VPP)
    (12, 3, 2, 2, 6, [[(0, 1), (6, 7)], [(1, 3), (7, 9)], [(3, 6), (9, 12)]]),
    (10, 2, 2, 4, None, [[(0, 2), (5, 7)], [(2, 5), (7, 10)]]),
    # a rank's count that does not divide by v (Megatron refuses it): the earlier chunks get one
    # layer more; Llama 3 405B's shape in small: first and last rank 7 layers, the middle 8, v 4
    (6, 2, 2, None, None, [[(0, 2), (4, 5)], [(2, 4), (5, 6)]]),
    (22, 3, 4, 7, 7, LLAMA_405B_IN_SMALL),
]


@pytest.mark.parametrize("num_layers, pp, v, first, last, expected", VIRTUAL)
def test_virtual_stages(num_layers, pp, v, first, last, expected):
    kwargs = dict(num_virtual_stages=v, first_stage_layers=first, last_stage_layers=last)
    assert stage_layer_ranges(num_layers, pp, **kwargs) == expected
    assert chunk_layer_ranges(num_layers, pp, **kwargs) == expected
    # every layer once; chunk c of rank r is block c * pp + r
    blocks = sorted(
        (c * pp + r, rng) for r, chunks in enumerate(expected) for c, rng in enumerate(chunks)
    )
    flat = [rng for _, rng in blocks]
    assert flat[0][0] == 0 and flat[-1][1] == num_layers
    assert all(a[1] == b[0] for a, b in zip(flat, flat[1:]))


@pytest.mark.parametrize(
    "args, kwargs, message",
    [
        ((7, 2), {}, "num_layers 7 is not divisible by pp_size 2"),
        (
            (7, 3),
            dict(first_stage_layers=2),
            "num_layers 7 minus the first/last stage layers (2) "
            "leaves 5, which does not split evenly over the other 2 pipeline",
        ),
        ((4, 1), dict(first_stage_layers=2), "first_stage_layers needs pp_size > 1"),
        ((4, 2), dict(last_stage_layers=0), "last_stage_layers must be >= 1, got 0"),
        (
            (4, 2),
            dict(first_stage_layers=1, last_stage_layers=2),
            "first_stage_layers + last_stage_layers = 3 but num_layers is 4",
        ),
        (
            (6, 2),
            dict(num_virtual_stages=4),
            "pipeline rank 0 holds 3 layers, fewer than num_virtual_stages 4",
        ),
        (
            (10, 2),
            dict(num_virtual_stages=4, first_stage_layers=3),
            "pipeline rank 0 holds 3 layers, fewer than num_virtual_stages 4",
        ),
        ((8, 2), dict(num_virtual_stages=0), "num_virtual_stages >= 1"),
    ],
)
def test_errors_name_the_parameters(args, kwargs, message):
    with pytest.raises(ValueError) as err:
        stage_layer_ranges(*args, **kwargs)
    assert message in str(err.value) and "\n" not in str(err.value) and "--" not in str(err.value)

"""The compressed all-reduce equals its definition computed in one process.

Each rank draws every rank's inputs from one seed, runs the collective on its own over the DP group
(``mesh()``: DP = world), and compares with ``reference_allreduce`` over the whole list (which
writes chunk by chunk, without packing). Three calls in a row, so the worker and server errors
that feed back are checked too. Sizes do not divide evenly: 37 elements over 4 ranks leaves the
last chunk empty, over 3 ranks a short one; blocks of 8 values give each chunk several scales,
the last block of a short chunk shorter still. Tolerance 1e-6 relative: the same fp32 sums in a
different arrangement; a sign lost in packing would miss by the whole scale.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megalite.core.distributed.compressed_allreduce import (
    CompressedAllReduce,
    chunk_lengths,
    chunk_numel,
    pack_signs,
    reference_allreduce,
    unpack_signs,
    wire_bytes,
)
from megalite.measure.comm_log import CommLog
from tests.harness import run_distributed
from tests.mesh import mesh

CALLS = 3


def _inputs(n: int, numel: int) -> list[list[torch.Tensor]]:
    """``[call][rank]`` inputs: different scales per rank so the scales matter."""
    gen = torch.Generator().manual_seed(7)
    return [[torch.randn(numel, generator=gen) * (1 + r) for r in range(n)] for _ in range(CALLS)]


def _case(numel: int, block: int) -> None:
    ps = mesh()
    group, n, rank = ps.group("dp"), ps.size("dp"), ps.rank("dp")
    assert n == dist.get_world_size()
    inputs = _inputs(n, numel)
    worker = [torch.zeros(numel) for _ in range(n)]
    server = [torch.zeros(chunk_numel(numel, n)) for _ in range(n)]
    car = CompressedAllReduce(numel, group, block=block)
    for call in range(CALLS):
        with CommLog() as log:
            got = car(inputs[call][rank])
        want = reference_allreduce(inputs[call], worker, server, block)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(car.worker_error, worker[rank], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(car.server_error, server[rank], rtol=1e-6, atol=1e-6)
        assert sum(b for _, _, b in log.records) == wire_bytes(numel, n, block)
        assert {(op, size) for op, size, _ in log.records} == {("all_to_all", n), ("all_gather", n)}


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("numel", [37, 130])
def test_equals_definition(world: int, numel: int) -> None:
    # the default block (one scale per chunk at these sizes), and blocks of 8 values: several
    # per chunk, the last of a short chunk shorter still
    for block in (1024, 8):
        run_distributed(_case, world, numel, block)


def test_one_rank_is_the_same_arithmetic() -> None:
    xs = _inputs(1, 21)
    worker, server = [torch.zeros(21)], [torch.zeros(chunk_numel(21, 1))]
    car = CompressedAllReduce(21, None)
    for call in range(CALLS):
        got = car(xs[call][0])
        torch.testing.assert_close(got, reference_allreduce(xs[call], worker, server))
    assert wire_bytes(21, 1) == 0


def test_pack_round_trip_and_chunks() -> None:
    x = torch.tensor([[1.0, -2.0, 0.0, -0.5, 3.0, -1.0, -1.0, 2.0] * 2])
    assert pack_signs(x).tolist() == [[0b10010101, 0b10010101]]
    assert torch.equal(unpack_signs(pack_signs(x)), torch.where(x >= 0, 1.0, -1.0))
    assert chunk_numel(37, 4) == 16 and chunk_lengths(37, 4) == [16, 16, 5, 0]
    # 1000 fp32 over 4 ranks: 4 chunks of 250 -> 256 elements, 32 sign bytes + 4 scale bytes
    assert wire_bytes(1000, 4) == 2 * 4 * (32 + 4)
    assert wire_bytes(1000, 4, block=64) == 2 * 4 * (32 + 4 * 4)  # 4 scales per chunk

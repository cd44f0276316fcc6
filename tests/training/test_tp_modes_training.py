"""Training equivalence under the grid tensor-parallel modes: 5 steps of the real loop under 2d and
2.5d, alone, with PP 2 and with DP 2 (ZeRO-1), give the single-process losses and grad norms.

Both families (GPT-2: learned positions, LayerNorm, tied embedding; Llama: RoPE, RMSNorm, SwiGLU,
GQA, untied output). The oracle is the same GPTModel built with ``ParallelState.single()`` in one
rank, fed every micro-batch of each global batch, with the same optimizer (AdamW, cosine schedule,
clipping at 1.0). Micro-batches of 4 sequences, so that 2.5d's depth 2 x q 2 = 4 batch blocks each
hold one. Tolerance 1e-5 relative, as tests/training/test_equivalence.py: fp32 sums taken in
another order; a wrong grad moves the loss by > 1e-3 from step 2 on.

Layouts: 2d is TP 4 (2 x 2); 2.5d is TP 8 (depth 2 x 2 x 2) alone, and TP 2 (depth 2 x 1 x 1:
the depth axis alone, the batch split in two) with PP 2 and DP 2, so that every case fits 8 CPU
ranks.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from megalite.core.parallel_state import ParallelState
from tests.harness import run_distributed
from tests.mesh import mesh
from tests.training.common import FAMILIES, assert_close_rel, config, train_losses

REL = 1e-5
MICRO = ["--micro-batch-size", "4"]


def _oracle(family: str) -> tuple[list[float], list[float]]:
    result = train_losses(config(*FAMILIES[family], *MICRO), ParallelState.single())
    return result.losses, result.grad_norms


def _case(family: str, mode: str, tp: int, depth: int, pp: int, zero1: bool) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    extra = [*FAMILIES[family], *MICRO, "--tensor-parallel-mode", mode]
    extra += ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]
    if depth > 1:
        extra += ["--tensor-parallel-depth", str(depth)]
    if zero1:
        extra.append("--use-distributed-optimizer")
    cfg = config(*extra, world_size=world, rank=rank)
    ps = mesh(tp, pp, mode=mode, depth=depth)
    try:
        result = train_losses(cfg, ps)
        out = {"dp": ps.dp_size, "last": ps.is_last_stage}
        out["run"] = (result.losses, result.grad_norms)
    finally:
        ps.destroy()
    if rank == 0:
        out["oracle"] = _oracle(family)
    return out


def _check(results: list[dict], what: str) -> None:
    losses, norms = results[0]["oracle"]
    assert losses[-1] < losses[0], losses  # the oracle trains: the check is not vacuous
    for rank, r in enumerate(results):
        got_losses, got_norms = r["run"]
        if r["last"]:
            assert_close_rel(got_losses, losses, REL, f"{what} rank {rank} loss")
        assert_close_rel(got_norms, norms, REL, f"{what} rank {rank} grad norm")


LAYOUTS = {  # name -> (mode, tp, depth, pp, zero1, world)
    "2d-tp4": ("2d", 4, 1, 1, False, 4),
    "2d-tp4-pp2": ("2d", 4, 1, 2, False, 8),
    "2d-tp4-dp2-zero1": ("2d", 4, 1, 1, True, 8),
    "2.5d-tp8": ("2.5d", 8, 2, 1, False, 8),
    "2.5d-tp2-pp2": ("2.5d", 2, 2, 2, False, 4),
    "2.5d-tp2-dp2-zero1": ("2.5d", 2, 2, 1, True, 4),
    "3d-tp8": ("3d", 8, 1, 1, False, 8),
    "3d-tp1-pp2": ("3d", 1, 1, 2, False, 2),
    "3d-tp1-dp2-zero1": ("3d", 1, 1, 1, True, 2),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_grid_modes_train_as_the_single_process(family, layout):
    mode, tp, depth, pp, zero1, world = LAYOUTS[layout]
    results = run_distributed(_case, world, family, mode, tp, depth, pp, zero1)
    _check(results, f"{family} {layout}")

"""Training equivalence under the grid tensor-parallel modes: 5 steps of the real loop under 2d,
2.5d and 3d, alone, with PP 2 and with DP 2 (ZeRO-1), give the single-process losses and grad
norms.

Both families (GPT-2: learned positions, LayerNorm, tied embedding; Llama: RoPE, RMSNorm, SwiGLU,
GQA, untied output). The oracle is the same GPTModel built with ``ParallelState.single()`` in one
rank, fed every micro-batch of each global batch, with the same optimizer (AdamW, cosine schedule,
clipping at 1.0). Micro-batches of 4 sequences, so that 2.5d's depth 2 x q 2 = 4 batch blocks each
hold one. Tolerance 1e-5 relative, as tests/training/test_equivalence.py: fp32 sums taken in
another order; a wrong grad moves the loss by > 1e-3 from step 2 on.

Layouts: 2d is TP 4 (2 x 2), alone and with PP 2 and DP 2 (8 ranks); 2.5d is TP 8 (depth 2 x 2 x
2) and 3d TP 8 (2 x 2 x 2), alone (8 ranks) and with PP 2 and DP 2 (16 ranks). The 16-rank cases
run one after the other in one launch (``runs_16``): on CPU, starting 16 gloo ranks costs more than
a case; there the families alternate (GPT-2 under 2.5d x PP 2 and 3d x DP 2, Llama under 2.5d x
DP 2 and 3d x PP 2).
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


def _case(
    family: str, mode: str, tp: int, depth: int, pp: int, zero1: bool, *, oracle: bool = True
) -> dict:
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
    if rank == 0 and oracle:
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
    "3d-tp8": ("3d", 8, 1, 1, False, 8),
}
# 16 ranks: the 2.5d (depth 2 x 2 x 2) and 3d (2 x 2 x 2) grids of TP 8 beside PP 2 or DP 2
LAYOUTS_16 = {  # name -> (mode, tp, depth, pp, zero1)
    "2.5d-tp8-pp2": ("2.5d", 8, 2, 2, False),
    "2.5d-tp8-dp2-zero1": ("2.5d", 8, 2, 1, True),
    "3d-tp8-pp2": ("3d", 8, 1, 2, False),
    "3d-tp8-dp2-zero1": ("3d", 8, 1, 1, True),
}
# the families alternate (each mode and each of PP 2 / DP 2 meets both): a 16-rank case costs a
# 2-core CI machine what a dozen small ones do
CASES_16 = [
    ("gpt2", "2.5d-tp8-pp2"),
    ("llama", "2.5d-tp8-dp2-zero1"),
    ("llama", "3d-tp8-pp2"),
    ("gpt2", "3d-tp8-dp2-zero1"),
]


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_grid_modes_train_as_the_single_process(family, layout):
    mode, tp, depth, pp, zero1, world = LAYOUTS[layout]
    results = run_distributed(_case, world, family, mode, tp, depth, pp, zero1)
    _check(results, f"{family} {layout}")


def _cases_16() -> dict[tuple[str, str], dict]:
    """Every 16-rank case in turn (one launch: starting 16 ranks costs more than a case)."""
    runs = {(f, name): _case(f, *LAYOUTS_16[name], oracle=False) for f, name in CASES_16}
    if dist.get_rank() == 0:
        for family in sorted({f for f, _ in CASES_16}):
            runs[family, "oracle"] = _oracle(family)
    return runs


@pytest.fixture(scope="module")
def runs_16() -> list[dict]:
    return run_distributed(_cases_16, 16)


@pytest.mark.parametrize("family,layout", CASES_16)
def test_grid_modes_train_as_the_single_process_at_16_ranks(runs_16, family, layout):
    results = [{**r[family, layout], "oracle": runs_16[0][family, "oracle"]} for r in runs_16]
    _check(results, f"{family} {layout}")

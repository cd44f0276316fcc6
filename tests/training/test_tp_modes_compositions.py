"""The grid tensor-parallel modes composed with the rest of the loop: recompute (full and
selective), bf16 and fp16, ZeRO-2 and ZeRO-3, and the pipeline schedules beyond 1F1B
(interleaved, zero-bubble, DualPipeV); 5 steps of the real loop equal the single process
(losses and grad norms, 1e-5 relative in fp32; bf16 and fp16 against the single process in the
same precision, at ``REL_OF``), as ``test_tp_modes_training.py`` checks the plain layouts.

Each case fits 4 CPU ranks: 2d at TP 4 (2 x 2), or 2.5d at TP 2 (depth 2 x 1 x 1: the depth axis,
which splits the batch, beside a second axis of 2 for DP or PP). The oracle is the same model
with the same flags less the layout ones (recompute, the ZeRO rung and the schedule change no
number in fp32 with dropout 0). The cases alternate the families (GPT-2, Llama).
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from megalite.core.parallel_state import ParallelState
from tests.harness import run_distributed
from tests.mesh import mesh
from tests.training.common import FAMILIES, assert_close_rel, config, train_losses

REL = 1e-5
# bf16 / fp16 against the single process in the same precision: 16-bit products summed in
# another order (one bf16 rounding is 4e-3 relative, one fp16 rounding 5e-4; 1d TP 2 x DP 2 in
# fp16 is within 2e-5 of the single process). Before the grid's norms took their statistics in
# fp32, every fp16 step overflowed and was skipped.
REL_OF = {"2d-bf16": 5e-3, "2.5d-dp2-fp16": 1e-4}
MICRO = ["--micro-batch-size", "4"]

CASES = {  # name -> (mode, tp, depth, pp, flags of the run, flags the oracle shares)
    "2d-recompute-full": (
        "2d",
        4,
        1,
        1,
        "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1",
        "",
    ),
    "2d-recompute-selective": ("2d", 4, 1, 1, "--recompute-granularity selective", ""),
    "2d-bf16": ("2d", 4, 1, 1, "", "--bf16"),
    "2.5d-dp2-fp16": ("2.5d", 2, 2, 1, "", "--fp16 --initial-loss-scale 1024"),
    "2.5d-dp2-zero2": ("2.5d", 2, 2, 1, "--data-parallel-sharding-strategy optim_grads", ""),
    "2.5d-dp2-zero3": (
        "2.5d",
        2,
        2,
        1,
        "--data-parallel-sharding-strategy optim_grads_params",
        "",
    ),
    "2.5d-pp2-interleaved": (
        "2.5d",
        2,
        2,
        2,
        "--pipeline-schedule interleaved-1f1b --num-layers-per-virtual-pipeline-stage 1",
        "--num-layers 4",
    ),
    "2.5d-pp2-zb-h1": ("2.5d", 2, 2, 2, "--pipeline-schedule zb-h1", ""),
    "2.5d-pp2-dualpipev": (
        "2.5d",
        2,
        2,
        2,
        "--pipeline-schedule dualpipev",
        "--num-layers 4 --global-batch-size 16",  # 4 micro-batches: 2 x PP
    ),
}


def _oracle(family: str, shared: list[str]) -> tuple[list[float], list[float]]:
    result = train_losses(config(*FAMILIES[family], *MICRO, *shared), ParallelState.single())
    return result.losses, result.grad_norms


def _case(family: str, name: str) -> dict:
    mode, tp, depth, pp, flags, shared = CASES[name]
    rank, world = dist.get_rank(), dist.get_world_size()
    extra = [*FAMILIES[family], *MICRO, *shared.split(), *flags.split()]
    extra += ["--tensor-parallel-mode", mode, "--tensor-model-parallel-size", str(tp)]
    extra += ["--pipeline-model-parallel-size", str(pp)]
    if depth > 1:
        extra += ["--tensor-parallel-depth", str(depth)]
    cfg = config(*extra, world_size=world, rank=rank)
    ps = mesh(tp, pp, mode=mode, depth=depth)
    try:
        result = train_losses(cfg, ps)
        out = {"last": ps.is_last_stage, "run": (result.losses, result.grad_norms)}
    finally:
        ps.destroy()
    if rank == 0:
        out["oracle"] = _oracle(family, shared.split())
    return out


# each case under one family (the families alternate), to keep the suite's time
FAMILY_OF = {name: sorted(FAMILIES)[i % 2] for i, name in enumerate(CASES)}


@pytest.mark.parametrize("name", list(CASES))
def test_grid_modes_compose_with_recompute_zero_and_schedules(name):
    family = FAMILY_OF[name]
    results = run_distributed(_case, 4, family, name)
    rel = REL_OF.get(name, REL)
    losses, norms = results[0]["oracle"]
    assert losses[-1] < losses[0], losses  # the oracle trains: the check is not vacuous
    for rank, r in enumerate(results):
        got_losses, got_norms = r["run"]
        if r["last"]:
            assert_close_rel(got_losses, losses, rel, f"{family} {name} rank {rank} loss")
        assert_close_rel(got_norms, norms, rel, f"{family} {name} rank {rank} grad norm")

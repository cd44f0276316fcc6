"""Training equivalence: 5 steps of the real loop under TP x SP x DP give the single-process losses.

For both families (GPT-2 and Llama: RoPE, RMSNorm, SwiGLU, GQA, no biases, untied output), at
TP in {1, 2}, sequence parallel off/on, DP in {1, 2}: the 5 logged losses (fp32, dropout 0, the same
seed and global batches) equal those of the oracle, the same GPTModel built with
``ParallelState.single()`` in one rank and fed every micro-batch of the global batch, with the same
optimizer (AdamW, cosine schedule, clipping at 1.0, a contiguous grad buffer with small buckets so
that several buckets are reduced). Tolerance 1e-5 relative: fp32 sums taken in a different order
(TP partial products, DP averaging, the clipped norm) differ by ~1e-7 per step, and a wrong grad
(a missing SP all-reduce, DP sum instead of mean, a tied-embedding grad counted twice) moves the
loss by > 1e-3 from step 2 on.

Recomputation at the training level: ``--recompute-granularity full`` (uniform and block) and
``selective`` give the no-recompute losses, also with dropout 0.1 (RNG states replayed), over 3
steps (the losses of steps 2 and 3 carry two updates made from the recomputed grads).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megalite.core.parallel_state import ParallelState
from tests.harness import run_distributed
from tests.mesh import mesh
from tests.training.common import FAMILIES, assert_close_rel, config, train_losses

REL = 1e-5
BUCKETS = ["--ddp-bucket-size", "5000"]  # ~10 buckets: bucketing is exercised


def _oracle(family: str) -> tuple[list[float], list[float]]:
    cfg = config(*FAMILIES[family], *BUCKETS)
    result = train_losses(cfg, ParallelState.single())
    return result.losses, result.grad_norms


def _layouts_case(layouts: list[tuple[str, int, bool]]) -> dict:
    """Every rank: the losses of each (family, tp, sp) layout; plus the oracle of the families
    this rank is assigned (family i on rank i % world)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    families = sorted({f for f, _, _ in layouts})
    oracles = {f: _oracle(f) for i, f in enumerate(families) if i % world == rank}
    runs = {}
    for family, tp, sp in layouts:
        extra = [*FAMILIES[family], *BUCKETS, "--tensor-model-parallel-size", str(tp)]
        if sp:
            extra.append("--sequence-parallel")
        cfg = config(*extra, world_size=world, rank=rank)
        ps = mesh(tp, 1)
        try:
            result = train_losses(cfg, ps)
            runs[(family, tp, sp)] = (ps.dp_size, (result.losses, result.grad_norms))
        finally:
            ps.destroy()
    return {"oracles": oracles, "runs": runs}


def _check(results: list[dict]) -> None:
    oracles = {}
    for r in results:
        oracles.update(r["oracles"])
    for rank, r in enumerate(results):
        for (family, tp, sp), (dp, (losses, norms)) in r["runs"].items():
            what = f"{family} TP{tp} DP{dp} SP={'on' if sp else 'off'} rank {rank}"
            assert_close_rel(norms, oracles[family][1], REL, what + " grad norm")
            assert_close_rel(losses, oracles[family][0], REL, what + " loss")
    # the oracle itself trains: the check is not vacuous
    for losses, _ in oracles.values():
        assert losses[-1] < losses[0], losses


def test_tp1_dp1_in_process_equals_oracle():
    """A world of one with real (size-1) process groups against the group-less oracle."""
    from megalite.core.parallel_state import init_single_process

    owns = not dist.is_initialized()
    if owns:
        init_single_process()
    try:
        for family in FAMILIES:
            ps = mesh(1, 1)
            try:
                result = train_losses(config(*FAMILIES[family], *BUCKETS), ps)
            finally:
                ps.destroy()
            losses, norms = _oracle(family)
            assert_close_rel(result.losses, losses, REL, f"{family} TP1 DP1 loss")
            assert_close_rel(result.grad_norms, norms, REL, f"{family} TP1 DP1 grad norm")
    finally:
        if owns:
            dist.destroy_process_group()


def test_two_ranks_tp2_sp_and_dp2_equal_oracle():
    layouts = [(f, tp, sp) for f in FAMILIES for tp, sp in ((1, False), (2, False), (2, True))]
    _check(run_distributed(_layouts_case, 2, layouts, timeout=600))


def test_four_ranks_tp2_dp2_equal_oracle():
    layouts = [(f, 2, sp) for f in FAMILIES for sp in (False, True)]
    _check(run_distributed(_layouts_case, 4, layouts, timeout=600))


RECOMPUTE_ITERS = ("--train-iters", "3")


def _recompute_case(dropout: float) -> dict[str, list[float]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    variants = {
        "none": [],
        "full-uniform": "--recompute-granularity full --recompute-method uniform "
        "--recompute-num-layers 1".split(),
        "full-block": "--recompute-granularity full --recompute-method block "
        "--recompute-num-layers 1".split(),
        "selective": ["--recompute-granularity", "selective"],
    }
    out = {}
    for family in FAMILIES:
        for name, flags in variants.items():
            extra = [*FAMILIES[family], "--tensor-model-parallel-size", "2", "--sequence-parallel"]
            extra += ["--hidden-dropout", str(dropout), "--attention-dropout", str(dropout)]
            cfg = config(*extra, *flags, *RECOMPUTE_ITERS, world_size=world, rank=rank)
            ps = mesh(2, 1)
            try:
                out[f"{family}/{name}"] = train_losses(cfg, ps, dropout_seeded=True).losses
            finally:
                ps.destroy()
    return out


def test_recompute_full_and_selective_equal_none_with_dropout():
    """TP2 + SP, dropout 0.1 on: recomputation must replay the dropout masks exactly, so the
    losses agree to 1e-6 relative (only the recomputed graph's summation order may differ)."""
    for rank_result in run_distributed(_recompute_case, 2, 0.1, timeout=600):
        for family in FAMILIES:
            ref = rank_result[f"{family}/none"]
            for name in ("full-uniform", "full-block", "selective"):
                got = rank_result[f"{family}/{name}"]
                assert_close_rel(got, ref, 1e-6, f"{family} recompute {name}")
    # dropout is really on: the no-recompute dropout run differs from the dropout-0 oracle
    assert abs(rank_result["gpt2/none"][0] - _oracle("gpt2")[0][0]) > 1e-4
    assert torch.isfinite(torch.tensor(ref)).all()

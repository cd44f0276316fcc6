"""ZeRO-1 (``--use-distributed-optimizer``) in the real training loop against the single process.

- fp32, both families, DP 1, 2, 4, TP2 x DP2 (sequence parallel), PP2 x DP2 (GPT-2: the tied
  embedding on the first and the last stage, its grad summed over the embedding group before the
  reduce-scatter), and ``--overlap-grad-reduce`` (reduce-scatters started from the grad hooks
  after the last of 2 micro-batches): the 5 losses and grad norms equal the oracle's, the same
  GPTModel with ``ParallelState.single()`` fed the whole global batch with the plain optimizer
  (``torch.optim.AdamW``), within 1e-6 relative (measured ~1e-7: only the order of the DP / TP
  sums and of the norm's squares differs). Overlap is bitwise the non-overlapped run.
- bf16 params, fp32 grads and masters, DP 2: within 1e-4 of the single-process bf16 run (also fp32
  masters). Each run is deterministic, but a 1e-7 difference in a master can round a bf16 param to
  the neighbouring value (2^-8 relative), which moves later losses by ~1e-5; a missing master or a
  wrong mean moves them by > 1e-3. (tests/core/optimizer/test_sharded_optimizer.py checks bf16
  exactly.)
- save -> load -> continue at DP 2: the model state and ``optimizer.state_dict()`` (this rank's
  shard) after 3 iterations, loaded into a fresh trainer that then runs iterations 4-5, give the
  uninterrupted run's losses exactly; the full (layout-independent) state loaded into a trainer
  with other buckets gives them within 1e-6.
- TP2 x PP2 x DP2 (8 ranks) with sequence parallel and both ``--overlap-grad-reduce`` and
  ``--overlap-param-gather``, both families: losses and grad norms equal the oracle's within 1e-5.
- the start-up memory report: one line per rank, measured bytes = theory within the padding.
- flags: ``--overlap-grad-reduce`` needs ``--use-distributed-optimizer``.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from megalite.core.optimizer.memory_report import log_model_state_memory
from megalite.core.parallel_state import ParallelState
from megalite.training.config import ConfigError
from megalite.training.forward_step import make_forward_step
from tests.harness import run_distributed
from tests.mesh import mesh
from tests.training.common import (
    FAMILIES,
    LogCapture,
    assert_close_rel,
    config,
    train_losses,
    trainer_and_data,
)

REL = 1e-6
ZERO = ["--use-distributed-optimizer", "--ddp-bucket-size", "5000"]
BF16 = ["--bf16", "--accumulate-allreduce-grads-in-fp32"]
OVERLAP = [
    "--overlap-grad-reduce"
]  # BASE: 8 per global batch, micro-batches of 2: 2 per rank at DP 2


def _oracle(family: str, extra: tuple[str, ...] = ()) -> tuple[list[float], list[float]]:
    result = train_losses(config(*FAMILIES[family], *extra), ParallelState.single())
    return result.losses, result.grad_norms


def _layouts_case(layouts: list[tuple[str, tuple[str, ...]]]) -> dict:
    """Every rank: (is_last_stage, losses, grad norms) of each (family, flags) layout."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for family, flags in layouts:
        cfg = config(*FAMILIES[family], *ZERO, *flags, world_size=world, rank=rank)
        par = cfg.parallel
        ps = mesh(par.tensor_model_parallel_size, par.pipeline_model_parallel_size)
        try:
            result = train_losses(cfg, ps)
        finally:
            ps.destroy()
        out[(family, flags)] = (ps.is_last_stage, result.losses, result.grad_norms)
    return out


def _check(layouts, results, oracles, rel: float = REL) -> None:
    for family, flags in layouts:
        losses, norms = oracles[family]
        assert losses[-1] < losses[0], "the oracle does not train: the check is vacuous"
        for rank, r in enumerate(results):
            is_last, got_losses, got_norms = r[(family, flags)]
            what = f"{family} {' '.join(flags)} rank {rank}"
            assert_close_rel(got_norms, norms, rel, what + " grad norm")
            if is_last:
                assert_close_rel(got_losses, losses, rel, what + " loss")


def test_dp1_in_process_equals_oracle():
    for family in FAMILIES:
        result = train_losses(config(*FAMILIES[family], *ZERO), ParallelState.single())
        losses, norms = _oracle(family)
        assert_close_rel(result.losses, losses, REL, f"{family} DP1 loss")
        assert_close_rel(result.grad_norms, norms, REL, f"{family} DP1 grad norm")


def test_dp2_both_families_overlap_and_bf16():
    layouts = [(f, ()) for f in FAMILIES] + [("gpt2", tuple(OVERLAP)), ("gpt2", tuple(BF16))]
    results = run_distributed(_layouts_case, 2, layouts, timeout=600)
    oracles = {f: _oracle(f) for f in FAMILIES}
    _check(layouts[:3], results, oracles)
    bf16_losses, bf16_norms = _oracle("gpt2", tuple(BF16))
    for r in results:
        _, losses, norms = r[("gpt2", tuple(BF16))]
        assert_close_rel(losses, bf16_losses, 1e-4, "gpt2 bf16 DP2 loss")
        assert_close_rel(norms, bf16_norms, 1e-3, "gpt2 bf16 DP2 grad norm")
        assert r[("gpt2", ())][1:] == r[("gpt2", tuple(OVERLAP))][1:]  # overlap: bitwise


def test_dp4_tp2_dp2_and_pp2_dp2_equal_oracle():
    layouts = [
        ("gpt2", ()),
        ("llama", ("--tensor-model-parallel-size", "2", "--sequence-parallel")),
        ("gpt2", ("--tensor-model-parallel-size", "2", "--sequence-parallel", *OVERLAP)),
        ("gpt2", ("--pipeline-model-parallel-size", "2")),
        ("gpt2", ("--pipeline-model-parallel-size", "2", *OVERLAP)),
    ]
    results = run_distributed(_layouts_case, 4, layouts, timeout=600)
    _check(layouts, results, {f: _oracle(f) for f in FAMILIES})


def test_tp2_pp2_dp2_sequence_parallel_with_both_overlaps_equals_oracle():
    """8 ranks: TP 2 (sequence parallel) x PP 2 x DP 2, ZeRO-1 with the grad reduce-scatters
    started from the hooks after the last of 2 micro-batches and the param all-gathers waited for
    by the forward. 1e-5: the TP, PP and DP sums and the norm's squares run in another order."""
    flags = tuple(
        (
            "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "
            "--sequence-parallel --overlap-grad-reduce --overlap-param-gather"
        ).split()
    )
    layouts = [(family, flags) for family in FAMILIES]
    results = run_distributed(_layouts_case, 8, layouts, timeout=600)
    _check(layouts, results, {f: _oracle(f) for f in FAMILIES}, rel=1e-5)
    assert sum(r[layouts[0]][0] for r in results) == 4  # TP 2 x DP 2 ranks on the last stage


# --- save -> load -> continue ----------------------------------------------------------------


def _skip(data, n: int):
    return itertools.islice(data, n, None)


def _resume_case() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    forward = make_forward_step(torch.device("cpu"))
    ps = mesh(1, 1)
    try:
        cfg = config(*ZERO, *BF16, world_size=world, rank=rank)
        uninterrupted = trainer_and_data(cfg, ps)
        full_run = uninterrupted[0].train(forward, uninterrupted[1]).losses

        first, data = trainer_and_data(cfg, ps)
        first.cfg.training.train_iters = 3
        head = first.train(forward, data).losses
        saved = {
            "model": {k: v.clone() for k, v in first.model[0].grad_wrapper.state_dict().items()},
            "optimizer": first.optimizer.state_dict(),
            "full": first.optimizer.full_state_dict(),
            "scheduler": first.scheduler.state_dict(),
        }
        tails = {}
        for name, flags in (("sharded", ()), ("full", ("--ddp-bucket-size", "3000"))):
            resumed, data = trainer_and_data(
                config(*ZERO, *BF16, *flags, world_size=world, rank=rank), ps
            )
            resumed.model[0].grad_wrapper.load_state_dict(saved["model"])
            if name == "sharded":
                resumed.optimizer.load_state_dict(saved["optimizer"])
            else:
                resumed.optimizer.load_full_state_dict(saved["full"])
            resumed.scheduler.load_state_dict(saved["scheduler"])
            resumed.cfg.training.train_iters = 2
            skipped = _skip(data[0], 3 * resumed.num_microbatches)
            tails[name] = resumed.train(forward, skipped).losses
        return {"full_run": full_run, "head": head, "tails": tails}
    finally:
        ps.destroy()


def test_save_load_continue_gives_the_uninterrupted_losses():
    for r in run_distributed(_resume_case, 2, timeout=600):
        assert r["head"] == r["full_run"][:3]
        assert r["tails"]["sharded"] == r["full_run"][3:], (r["tails"], r["full_run"])
        assert_close_rel(r["tails"]["full"], r["full_run"][3:], REL, "full-state resume")


# --- start-up memory report and flags --------------------------------------------------------


def _memory_case() -> tuple[list, list[str]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    ps = mesh(1, 1)
    try:
        trainer, _ = trainer_and_data(config(*ZERO, *BF16, world_size=world, rank=rank), ps)
        with LogCapture() as logs:
            rows = log_model_state_memory(trainer.model[0].grad_wrapper, trainer.optimizer, ps)
        return rows, logs.lines
    finally:
        ps.destroy()


def test_startup_memory_report_matches_theory():
    results = run_distributed(_memory_case, 2, timeout=600)
    rows, lines = results[0]
    assert "2P + 4P + 12P/2" in lines[0]
    assert [ln.split(":")[0].strip() for ln in lines[1:]] == ["rank 0", "rank 1"]
    for s in rows:
        # padding: < 2 elements per bucket (P / 5000 buckets + 1), 18 bytes each; step counters
        slack = 18 * (s.num_params // 5000 + 2) + 4 * 64
        assert abs(s.total - s.theory) <= slack, (s.total, s.theory)
        assert abs(s.master + s.optimizer - 12 * s.num_params / 2) <= slack


@pytest.mark.parametrize(
    "flags, ok",
    [(["--overlap-grad-reduce"], False), (["--overlap-grad-reduce", *ZERO], True)],
)
def test_overlap_grad_reduce_needs_the_distributed_optimizer(flags, ok):
    if ok:
        assert config(*flags).parallel.overlap_grad_reduce
    else:
        with pytest.raises(ConfigError, match="needs|only"):
            config(*flags)

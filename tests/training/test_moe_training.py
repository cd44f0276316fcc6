"""MoE models in the real training loop against the single process (fp32, 1e-5 relative).

Both families with MoE layers (GPT-2: every layer, GELU experts, the alltoall dispatcher; Llama:
SwiGLU experts, a gated shared expert, ``--moe-layer-freq [0,1]``, the allgather dispatcher), aux
and z losses on. The oracle is the same model in one process (``ParallelState.single()``) fed the
whole global batch. On 8 ranks:

- EP2 x TP2 (sequence parallel) x DP2, and EP2 x PP2 (x DP4): the 5 losses, the load-balancing and
  z losses (``TrainResult.moe_losses``) and the grad norms equal the oracle's.
- ZeRO-1 (``--use-distributed-optimizer``) at TP2 (SP) x EP2 x ETP1: expert state sharded over
  edp 2, dense state over dp 4; the same numbers.
- the aux-loss gradient invariant across more layouts: DP 1 (TP4 x PP2 x EP4, 4 micro-batches per
  rank), DP 2, DP 4 (TP2 without sequence parallel x EP4 x ETP1, 1 micro-batch per rank) with a
  large aux coefficient so that a mis-scaled aux grad moves the losses: losses, aux losses and grad
  norms = the oracle's. The micro-batch is the unit of the aux statistics (Megatron's
  ``aux_loss``: the micro-batch's tokens across TP and CP), so micro_batch_size stays 2.

1e-5: TP, EP, DP sums and the norm's squares run in another order than in one process.
"""

from __future__ import annotations

import functools
import os
import tempfile

import pytest
import torch.distributed as dist

from megalite.core.parallel_state import ParallelState
from megalite.training.pretrain import mesh_for, pretrain
from tests.harness import run_distributed
from tests.training.common import (
    FAMILIES,
    MOE,
    STRONG_AUX,
    assert_close_rel,
    config,
    train_losses,
)

REL = 1e-5
GLOBAL_AUX = (*STRONG_AUX, "--moe-router-load-balancing-type", "global_aux_loss")


def _flags(family: str, extra=()) -> list[str]:
    return [*FAMILIES[family], *MOE[family], *extra]


def _summary(result) -> tuple[list[float], list[float], list[float], list[float]]:
    aux = [m["load_balancing_loss"] for m in result.moe_losses]
    z = [m["z_loss"] for m in result.moe_losses]
    return result.losses, result.grad_norms, aux, z


@functools.cache
def _oracle(family: str, extra=()) -> tuple:
    return _summary(train_losses(config(*_flags(family, extra)), ParallelState.single()))


def _oracle_extra(model_extra: tuple, layout: tuple) -> tuple:
    """``global_aux_loss`` counts the tokens of the data-parallel micro-step (micro_batch_size x
    dp consecutive samples): its oracle's micro-batch is that micro-step, same micro-batch count."""
    if "global_aux_loss" not in model_extra:
        return model_extra
    sizes = dict(zip(layout[::2], layout[1::2]))
    dp = 8 // (
        int(sizes["--tensor-model-parallel-size"]) * int(sizes["--pipeline-model-parallel-size"])
    )
    mbs = int(sizes.get("--micro-batch-size", 2))
    return (*model_extra, "--micro-batch-size", str(mbs * dp))


def _layouts_case(layouts: list[tuple[str, tuple, tuple]]) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for family, model_extra, layout in layouts:
        cfg = config(*_flags(family, model_extra), *layout, world_size=world, rank=rank)
        ps = mesh_for(cfg.parallel)
        try:
            result = train_losses(cfg, ps)
        finally:
            ps.destroy()
        out[(family, model_extra, layout)] = (ps.is_last_stage, _summary(result))
    return out


def _check(layouts, results) -> None:
    for family, model_extra, layout in layouts:
        losses, norms, aux, z = _oracle(family, _oracle_extra(model_extra, layout))
        assert max(losses) - min(losses) > 1e-4, "the oracle's losses do not move: vacuous"
        assert len(aux) == 5 and min(aux) > 0 and min(z) > 0
        for rank, r in enumerate(results):
            is_last, (got_losses, got_norms, got_aux, got_z) = r[(family, model_extra, layout)]
            what = f"{family} {' '.join(model_extra + layout)} rank {rank}"
            assert_close_rel(got_norms, norms, REL, what + " grad norm")
            assert_close_rel(got_aux, aux, REL, what + " load-balancing loss")
            assert_close_rel(got_z, z, REL, what + " z loss")
            if is_last:
                assert_close_rel(got_losses, losses, REL, what + " loss")


def _sizes(tp=1, pp=1, ep=1, etp=None, sp=False) -> tuple[str, ...]:
    flags = [
        "--tensor-model-parallel-size",
        str(tp),
        "--pipeline-model-parallel-size",
        str(pp),
        "--expert-model-parallel-size",
        str(ep),
    ]
    if etp is not None:
        flags += ["--expert-tensor-parallel-size", str(etp)]
    return (*flags, *(["--sequence-parallel"] if sp else []))


def test_moe_whole_model_ep_tp_dp_pp_and_aux_invariant_equal_single_process():
    layouts = [
        ("gpt2", (), _sizes(tp=2, ep=2, sp=True)),  # EP2 x TP2 (SP) x DP2, ETP = TP
        ("llama", (), _sizes(tp=2, ep=2, sp=True)),
        ("gpt2", (), _sizes(pp=2, ep=2)),  # EP2 x PP2 x DP4
        ("llama", (), _sizes(pp=2, ep=2)),
        ("gpt2", STRONG_AUX, _sizes(tp=4, pp=2, ep=4, etp=1)),  # DP1, 4 micro-batches per rank
        ("gpt2", STRONG_AUX, _sizes(tp=2, ep=4, etp=1)),  # DP4, TP without SP, 1 micro-batch
        # ZeRO-1: expert optimizer state sharded over edp 2, dense over dp 4
        ("llama", ("--use-distributed-optimizer",), _sizes(tp=2, ep=2, etp=1, sp=True)),
        # global_aux_loss: DP1 x 4 micro-steps, DP2 (TP2 SP x PP2) x 2, DP4 (TP2) x 2
        ("gpt2", GLOBAL_AUX, _sizes(tp=4, pp=2, ep=4, etp=1)),
        ("gpt2", GLOBAL_AUX, _sizes(tp=2, pp=2, ep=2, sp=True)),
        ("gpt2", GLOBAL_AUX, (*_sizes(tp=2, ep=4, etp=1), "--micro-batch-size", "1")),
    ]
    results = run_distributed(_layouts_case, 8, layouts, timeout=600)
    _check(layouts, results)


def test_moe_flag_errors_are_one_line_before_process_groups():
    from megalite.training.config import ConfigError

    cases = [
        (
            ["--num-experts", "4", "--expert-model-parallel-size", "3"],
            3,
            "--num-experts 4 is not divisible by --expert-model-parallel-size 3",
        ),
        (["--moe-aux-loss-coeff", "0.1"], 1, "need --num-experts"),
        (["--num-experts", "4", "--moe-layer-freq", "[1,0,1]"], 1, "--moe-layer-freq has 3"),
        (
            ["--num-experts", "4", "--expert-model-parallel-size", "4"],
            2,
            "world size 2 is not divisible by --expert-tensor-parallel-size 1 x",
        ),
        (
            (
                "--num-experts 4 --moe-ffn-hidden-size 6 "
                "--tensor-model-parallel-size 4 --sequence-parallel"
            ).split(),
            4,
            "--moe-ffn-hidden-size 6 is not divisible",
        ),
    ]
    for flags, world, message in cases:
        try:
            config(*flags, "--global-batch-size", str(2 * world * 4), world_size=world)
        except ConfigError as e:
            assert message in str(e) and "\n" not in str(e), (flags, str(e))
        else:
            raise AssertionError(f"{flags} was accepted")


def _save_case(root: str, families: list[str]) -> dict:
    """Iterations 1-4 at EP2 x TP2 (SP, ETP = TP) x DP2, saving at 2."""
    rank, world = dist.get_rank(), dist.get_world_size()
    env = {"RANK": str(rank), "WORLD_SIZE": str(world)}
    out = {}
    for family in families:
        save = ["--save", os.path.join(root, family), "--save-interval", "2"]
        flags = [*_flags(family), "--train-iters", "4", *save, *_sizes(tp=2, ep=2, sp=True)]
        out[family] = pretrain(config(*flags, world_size=world, rank=rank), env=env).losses
    return out


def _zero_save_and_reshard_case(root: str, cases: list[tuple[str, tuple, tuple, tuple]]) -> dict:
    """Per case: iterations 1-4 at ``saved`` (ZeRO, saving at 2), then 3-4 resumed from
    iteration 2 at ``resumed`` (another EP / ETP / TP / DP and ZeRO rung), in this world."""
    rank, world = dist.get_rank(), dist.get_world_size()
    env = {"RANK": str(rank), "WORLD_SIZE": str(world)}
    out = {}
    for name, zero, saved, resumed in cases:
        save = os.path.join(root, name)
        flags = [*_flags("llama"), "--train-iters", "4", "--save", save, "--save-interval", "2"]
        straight = pretrain(config(*flags, *zero, *saved, world_size=world, rank=rank), env=env)
        load = [*_flags("llama"), "--train-iters", "4", "--load", save, "--ckpt-step", "2"]
        again = pretrain(config(*load, *resumed, world_size=world, rank=rank), env=env)
        out[name] = (straight.losses, again.losses)
    return out


ZERO_CASES = [
    (
        "zero1",
        ("--use-distributed-optimizer",),
        _sizes(tp=2, ep=2, sp=True),
        ("--use-distributed-optimizer", *_sizes(ep=1)),
    ),
    (
        "zero3",
        ("--zero-stage", "3"),
        _sizes(ep=2),
        ("--zero-stage", "2", *_sizes(tp=2, ep=4, etp=1, sp=True)),
    ),
]


def _four_rank_checkpoint_case(root: str) -> dict:
    """Both checkpoint tests' distributed runs in one 4-rank world (one start-up)."""
    return {
        "plain": _save_case(root, ["llama"]),
        "zero": _zero_save_and_reshard_case(root, ZERO_CASES),
    }


@pytest.fixture(scope="module")
def four_rank_checkpoints():
    with tempfile.TemporaryDirectory() as root:
        yield root, run_distributed(_four_rank_checkpoint_case, 4, root, timeout=600)[-1]


def test_save_at_ep2_tp2_resume_at_ep1_tp1_continues(four_rank_checkpoints):
    """Experts are saved by global index (one file per EP x ETP rank), so the single process
    loads them all: iterations 3-4 from the checkpoint of iteration 2 = the uninterrupted run's
    (1e-5: the layout changed). Without the optimizer state they differ (not vacuous)."""
    root, results = four_rank_checkpoints
    straight = results["plain"]
    for family in ["llama"]:  # SwiGLU experts (ETP stride 2) and a gated shared expert
        assert len(straight[family]) == 4
        load = ["--train-iters", "4", "--load", os.path.join(root, family), "--ckpt-step", "2"]
        resumed = pretrain(config(*_flags(family), *load), env={}).losses
        assert_close_rel(resumed, straight[family][2:], REL, f"{family} at EP1 x TP1")
    fresh = pretrain(config(*_flags(family), *load, "--no-load-optim"), env={}).losses
    gap = max(abs(a - b) / abs(b) for a, b in zip(fresh, straight[family][2:]))
    assert gap > 10 * REL, f"the optimizer state makes no difference ({gap}): vacuous"


def test_zero_expert_optimizer_state_resumes_at_another_layout(four_rank_checkpoints):
    """ZeRO keeps the expert optimizer state sharded over edp; the checkpoint also writes it whole
    by global expert (gathered over edp), so it resumes at any layout: ZeRO-1 saved at EP2 x TP2
    (SP) x DP2 (edp 2) resumes at EP1 x DP4 ZeRO-1 (edp 4) and in one process without ZeRO;
    ZeRO-3 saved at EP2 x DP4 (edp 2) resumes at EP4 x ETP1 x TP2 x DP2 ZeRO-2 and in one
    process. Iterations 3-4 = the uninterrupted run's (1e-5)."""
    root, results = four_rank_checkpoints
    for name, _, _, _ in ZERO_CASES:
        straight, again = results["zero"][name]
        assert len(straight) == 4
        assert_close_rel(again, straight[2:], REL, f"{name} resumed in the 4-rank world")
        load = ["--train-iters", "4", "--load", os.path.join(root, name), "--ckpt-step", "2"]
        single = pretrain(config(*_flags("llama"), *load), env={}).losses
        assert_close_rel(single, straight[2:], REL, f"{name} resumed at EP1 x TP1")

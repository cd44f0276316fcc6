"""The ZeRO ladder in the real training loop against the single-process oracle.

- ZeRO-2 (``--zero-stage 2``) and ZeRO-3 (``--data-parallel-sharding-strategy
  optim_grads_params``), fp32, both families, on 4 ranks: DP 4, TP2 x DP2 with sequence
  parallel, PP2 x DP2 (GPT-2: the tied embedding on the first and last stage): the 5 losses and
  grad norms equal the oracle's (the same GPTModel on ``ParallelState.single()``, whole global
  batch, plain optimizer) within 1e-6. The global batch of 8 in micro-batches of 2 means 2 (DP 4:
  1) micro-batches per rank and step: gradient accumulation (and 1F1B re-gathering under PP) is
  in every case.
- save under ZeRO-3 at TP2 x PP2 x DP2 (8 ranks) after 3 iterations -> resume under ZeRO-1 at
  TP1 x PP1 x DP2 and run iterations 4-5; and the reverse (ZeRO-1 at DP2 -> ZeRO-3 at
  TP2 x PP2 x DP2): the resumed losses equal the oracle's within 1e-5.
- flags: invalid combinations are refused in one line naming the flags.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megalite.core.parallel_state import ParallelState
from megalite.training.config import ConfigError
from megalite.training.forward_step import make_forward_step
from megalite.training.pretrain import build_run
from tests.harness import run_distributed
from tests.mesh import mesh
from tests.training.common import FAMILIES, assert_close_rel, config, train_losses

REL = 1e-6
BUCKETS = ("--ddp-bucket-size", "3000")  # several buckets per rank in these tiny models
RUNGS = {
    "zero2": ["--zero-stage", "2"],
    "zero3": ["--data-parallel-sharding-strategy", "optim_grads_params"],
}
LAYOUTS = [
    ("gpt2", ()),
    ("gpt2", ("--tensor-model-parallel-size", "2", "--sequence-parallel")),
    ("llama", ("--tensor-model-parallel-size", "2", "--sequence-parallel")),
    ("gpt2", ("--pipeline-model-parallel-size", "2")),
    ("llama", ("--pipeline-model-parallel-size", "2")),
]


def _mesh(cfg):
    par = cfg.parallel
    return mesh(par.tensor_model_parallel_size, par.pipeline_model_parallel_size)


def ladder_case(cases) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for rung, family, flags in cases:
        family_flags = (*FAMILIES[family], *RUNGS[rung], *BUCKETS)
        cfg = config(*family_flags, *flags, world_size=world, rank=rank)
        ps = _mesh(cfg)
        try:
            result = train_losses(cfg, ps)
        finally:
            ps.destroy()
        out[(rung, family, flags)] = (ps.is_last_stage, result.losses, result.grad_norms)
    return out


def test_zero2_and_zero3_train_like_the_oracle_at_every_layout():
    oracles = {}
    for family in FAMILIES:
        r = train_losses(config(*FAMILIES[family]), ParallelState.single())
        oracles[family] = (r.losses, r.grad_norms)
        assert r.losses[-1] < r.losses[0]
    cases = [(rung, fam, flags) for rung in RUNGS for fam, flags in LAYOUTS]
    for rank_out in run_distributed(ladder_case, 4, cases):
        for (rung, family, flags), (last, losses, norms) in rank_out.items():
            want_losses, want_norms = oracles[family]
            if last:
                assert_close_rel(losses, want_losses, REL, f"{rung} {family} {flags} loss")
            assert_close_rel(norms, want_norms, REL, f"{rung} {family} {flags} norm")


def save_or_resume_case(flags: tuple[str, ...], jobs: list[tuple[str | None, str | None]]) -> list:
    """Per ``(save, load)`` of ``jobs``: 5 iterations saving at 3 into ``save``, or resume
    ``load`` at 3 and run 4-5. Returns the resumed losses (last stage; None elsewhere)."""
    return [_save_or_resume(flags, save=save, load=load) for save, load in jobs]


def _save_or_resume(flags: tuple[str, ...], *, save: str | None, load: str | None) -> list:
    rank, world = dist.get_rank(), dist.get_world_size()
    args = [*flags, "--ddp-bucket-size", "3000"]
    args += ["--save", save, "--save-interval", "3"] if save else []
    args += ["--load", load, "--ckpt-step", "3"] if load else []
    cfg = config(*FAMILIES["gpt2"], *args, world_size=world, rank=rank)
    ps = _mesh(cfg)
    try:
        run = build_run(cfg, ps, torch.device("cpu"), resume=bool(load))
        result = run.trainer.train(make_forward_step(ps.device), run.train_iter)
    finally:
        ps.destroy()
    return result.losses if ps.is_last_stage else None


ZERO3_BIG = tuple(
    (
        "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "
        "--sequence-parallel --zero-stage 3"
    ).split()
)
ZERO1_SMALL = ("--use-distributed-optimizer",)


def test_zero3_checkpoint_resumes_under_zero1_at_another_layout_and_back(tmp_path):
    oracle = train_losses(config(*FAMILIES["gpt2"]), ParallelState.single()).losses
    big, small = str(tmp_path / "zero3"), str(tmp_path / "zero1")
    run_distributed(save_or_resume_case, 2, ZERO1_SMALL, [(small, None)])
    out = run_distributed(save_or_resume_case, 8, ZERO3_BIG, [(big, None), (None, small)])
    resumed_big = [r[1] for r in out if r[1] is not None]
    out = run_distributed(save_or_resume_case, 2, ZERO1_SMALL, [(None, big)])
    resumed_small = [r[0] for r in out if r[0] is not None]
    for losses in resumed_big + resumed_small:
        assert_close_rel(losses, oracle[3:], 1e-5, "resumed losses")
    assert resumed_big and resumed_small


def test_flags_refuse_invalid_combinations_in_one_line():
    for flags, words in [
        (["--zero-stage", "3", "--overlap-param-gather"], "--overlap-param-gather"),
        (["--zero-stage", "1", "--optimizer-offload-fraction", "2"], "[0, 1]"),
        (["--optimizer-cpu-offload"], "--zero-stage"),
        (["--zero-stage", "2", "--data-parallel-sharding-strategy", "optim"], "--zero-stage 2"),
    ]:
        with pytest.raises(ConfigError) as e:
            config(*flags)
        assert words in str(e.value) and "\n" not in str(e.value), (flags, str(e.value))
    assert config("--zero-stage", "2").parallel.sharding_strategy() == "optim_grads"
    assert config("--use-distributed-optimizer").parallel.sharding_strategy() == "optim"


RUNG_FLAGS = {
    0: [],
    1: ["--zero-stage", "1"],
    2: ["--zero-stage", "2"],
    3: ["--zero-stage", "3"],
    "offload": "--zero-stage 2 --optimizer-cpu-offload --optimizer-offload-fraction 0.5".split(),
}


def memory_case(tmp: str) -> dict:
    from megalite.core.optimizer.memory_report import log_model_state_memory

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for rung, flags in RUNG_FLAGS.items():
        precision = ("--bf16", "--accumulate-allreduce-grads-in-fp32")
        cfg = config(*FAMILIES["gpt2"], *precision, *BUCKETS, *flags, world_size=world, rank=rank)
        ps = _mesh(cfg)
        try:
            run = build_run(cfg, ps, torch.device("cpu"), resume=False)
            model, opt = run.trainer.model[0].grad_wrapper, run.trainer.optimizer
            rows = log_model_state_memory(model, opt, ps)
            counted = _count_storages(model, opt)
        finally:
            ps.destroy()
        out[rung] = (rows[rank], counted)
    return out


def _count_storages(model, opt) -> dict:
    """Bytes by kind from the tensors' storages, independently of the report."""

    def nbytes(tensors) -> int:
        seen = {}
        for t in tensors:
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
        return sum(seen.values())

    shards = list(getattr(model, "param_shards", {}).values())
    params = nbytes([*model.module.parameters(), *shards])
    grads = nbytes(b.data for b in model.grad_buffers)
    host = nbytes(t for sb in getattr(opt, "buffers", []) for t in sb.host.values())
    state = [
        t for sb in getattr(opt, "buffers", []) for t in (sb.master, sb.exp_avg, sb.exp_avg_sq)
    ]
    device = nbytes(t for t in state if t is not None)
    if not hasattr(opt, "buffers"):  # the plain optimizer: masters + lazily created moments
        device = nbytes(opt.master_params) + 8 * sum(m.numel() for m in opt.master_params)
    return {"params": params, "grads": grads, "device_optim": device, "host": host}


def test_memory_report_equals_storages_and_theory_for_every_rung(tmp_path):
    dp = 2
    for rank_out in run_distributed(memory_case, dp, str(tmp_path)):
        for rung, (s, counted) in rank_out.items():
            phi = s.num_params
            stage = 2 if rung == "offload" else rung
            pad = 4 * 18 * (phi // 3000 + 8)  # < dp elements per bucket, 18 bytes each
            assert s.stage == stage
            assert abs(s.params - 2 * phi / (dp if stage == 3 else 1)) <= pad, (rung, s)
            assert abs(s.grads - 4 * phi / (dp if stage >= 2 else 1)) <= pad, (rung, s)
            optim = 12 * phi / (dp if stage >= 1 else 1)
            steps = 4 * 64
            if rung == "offload":
                assert abs(s.host - optim / 2) <= pad and abs(s.theory_off - optim / 2) <= 1
                assert abs(s.master + s.optimizer - optim / 2) <= pad + steps
            else:
                assert s.host == 0 and abs(s.master + s.optimizer - optim) <= pad + steps
            assert abs(s.total - s.theory) <= pad + steps, (rung, s.total, s.theory)
            assert counted["params"] == s.params and counted["grads"] == s.grads, rung
            assert counted["host"] == s.host, rung
            assert abs(counted["device_optim"] - (s.master + s.optimizer)) <= steps, rung

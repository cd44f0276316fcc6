"""Exact resume: 2N iterations straight equal N iterations, a checkpoint, and N more after --load.

The real ``pretrain`` loop on mock data with dropout 0.1 (so the RNG states matter), a cosine LR
schedule (so the scheduler position matters) and AdamW (so the moments and fp32 masters matter).
The run that saves at N and goes on to 2N is the reference; the resumed run loads iteration N
(``--ckpt-step``) and runs N more. Its losses must be bitwise equal (``==``) to the reference's
last N: on CPU every operation is deterministic, so any state not restored exactly (an RNG, the
data position, a moment, the master weights of a bf16 run, the loss scale) shows as a difference.
The negative control (``--no-load-rng``) shows the comparison sees a missing RNG state.

Single process: both families, fp32 and bf16, and fp16 with a loss-scale overflow right after the
checkpoint; one run also evaluates every iteration, so the validation position must be restored
for its final validation and test losses to match. TP2 x PP2 x DP2 (8 ranks) with sequence
parallel and the ZeRO-1 distributed optimizer, fp32 (GPT-2) and bf16 (Llama), N = 2.
"""

from __future__ import annotations

import math
import os
import tempfile

import torch.distributed as dist

from megalite.checkpoint.files import read_tracker
from megalite.training.pretrain import pretrain
from tests.harness import run_distributed
from tests.training.common import FAMILIES, config

N = 2
DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]


def _runs(extra: list[str], save: str, *, world: int = 1, rank: int = 0):
    """The results of 2N iterations saving every N, and of the run resumed from N."""
    env = {"RANK": str(rank), "WORLD_SIZE": str(world)} if world > 1 else {}
    flags = [*extra, *DROPOUT, "--train-iters", str(2 * N)]
    flags += ["--save", save, "--save-interval", str(N)]
    straight = pretrain(config(*flags, world_size=world, rank=rank), env=env)
    resumed_cfg = config(*flags, "--load", save, "--ckpt-step", str(N), world_size=world, rank=rank)
    return straight, pretrain(resumed_cfg, env=env)


def _straight_and_resumed(extra: list[str], save: str, *, world: int = 1, rank: int = 0):
    """(losses of 2N iterations saving every N, losses of the run resumed from N)."""
    straight, resumed = _runs(extra, save, world=world, rank=rank)
    return straight.losses, resumed.losses


def test_resume_single_process_is_bitwise_exact_fp32_bf16_fp16():
    evaluate = ["--eval-interval", "1", "--eval-iters", "1"]  # the validation position too
    # fp16: the scale grows after 2 clean steps (iteration 2) and overflows at iteration 3, after
    # the checkpoint: only a restored loss scaler skips that step again
    fp16 = [
        *"--fp16 --initial-loss-scale 262144 --hysteresis 1 --loss-scale-window 2".split(),
    ]
    for family, extra in (
        ("gpt2", evaluate),
        ("llama", []),
        ("gpt2", ["--bf16"]),
        ("llama", ["--bf16"]),
        ("gpt2", fp16),
    ):
        with tempfile.TemporaryDirectory() as save:
            straight, resumed = _runs([*FAMILIES[family], *extra], save)
            assert len(straight.losses) == 2 * N and len(resumed.losses) == N
            assert resumed.losses == straight.losses[N:], (family, extra, straight, resumed)
            assert resumed.validation == straight.validation and resumed.test == straight.test
            skipped = [math.isnan(g) for g in straight.grad_norms]
            assert [math.isnan(g) for g in resumed.grad_norms] == skipped[N:]
            if extra == fp16:
                assert skipped == [False, False, True, False], straight.grad_norms
            assert read_tracker(save) == 2 * N
            assert sorted(os.listdir(save)) == [
                "iter_0000002",
                "iter_0000004",
                "latest_checkpointed_iteration.txt",
            ]
            assert os.path.isfile(
                os.path.join(save, "iter_0000002", "mp_rank_00", "model_optim_rng.pt")
            )
        if extra == evaluate:
            assert straight.validation, "no validation ran: the data-position check is vacuous"


def test_saving_does_not_perturb_and_rng_state_is_needed():
    """The reference is not disturbed by saving; a resume without the RNG states differs."""
    with tempfile.TemporaryDirectory() as save:
        plain = pretrain(config(*DROPOUT, "--train-iters", str(2 * N)), env={}).losses
        straight, resumed = _straight_and_resumed([], save)
        assert plain == straight
        no_rng = config(
            *DROPOUT,
            "--train-iters",
            str(2 * N),
            "--load",
            save,
            "--ckpt-step",
            str(N),
            "--no-load-rng",
        )
        losses = pretrain(no_rng, env={}).losses
        assert losses != straight[N:], "dropout masks do not depend on the RNG: vacuous test"


def _distributed_case(save_root: str, cases: list[tuple[str, list[str]]]) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for name, extra in cases:
        save = os.path.join(save_root, name)
        out[name] = _straight_and_resumed(extra, save, world=world, rank=rank)
    return out


def test_resume_tp2_pp2_dp2_zero1_is_bitwise_exact():
    layout = [
        *"--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2".split(),
        *"--sequence-parallel --use-distributed-optimizer".split(),
    ]
    cases = [
        ("gpt2_fp32", [*FAMILIES["gpt2"], *layout]),
        ("llama_bf16", [*FAMILIES["llama"], *layout, "--bf16"]),
    ]
    with tempfile.TemporaryDirectory() as root:
        results = run_distributed(_distributed_case, 8, root, cases, timeout=600)
        for name, _ in cases:
            iter_dir = os.path.join(root, name, "iter_0000002")
            shards = sorted(os.listdir(iter_dir))
            assert shards == [
                "mp_rank_00_000",
                "mp_rank_00_001",
                "mp_rank_01_000",
                "mp_rank_01_001",
            ], shards
            for shard in shards:
                files = sorted(os.listdir(os.path.join(iter_dir, shard)))
                assert files == [
                    "distrib_optim_000.pt",
                    "distrib_optim_001.pt",
                    "model_optim_rng.pt",
                ], files
    for rank, r in enumerate(results):
        for name, (straight, resumed) in r.items():
            if rank in (4, 5, 6, 7):  # the last pipeline stage logs the losses
                assert len(straight) == 2 * N, (name, rank, straight)
                assert resumed == straight[N:], (name, rank, straight, resumed)
            else:
                assert straight == resumed == []

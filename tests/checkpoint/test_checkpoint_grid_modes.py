"""A checkpoint saved under a grid tensor-parallel mode continues under 1d and in one process.

A 4-layer model trained at 2d TP 4 (2 x 2) x PP 2 saves at iteration 2 and goes on to 4 (the
unresharded continuation). From that checkpoint, 1d TP 2 x DP 4 (8 ranks) and one process run
iterations 3-4: losses within 1e-5 relative of the unresharded ones (fp32; only the order of sums
differs). GPT-2 (tied embedding: the output layer shares the word table's grid blocks) with the
plain optimizer, Llama (SwiGLU's strided fc1, GQA, untied output) with ZeRO-1. The control:
continuing without the optimizer state moves the losses by more than 10x the tolerance.

Saved under 3d TP 8 (q = 2, the cube's blocks: ``tp_shards``), the 2-layer GPT-2 with ZeRO-1
(biases, learned positions, the tied table in the cube's vocabulary blocks) continues at 1d TP 2 x
DP 4 and in one process with the same tolerance. (Into a grid from another layout:
``test_checkpoint_into_modes.py``.)
"""

from __future__ import annotations

import os
import tempfile

import torch.distributed as dist

from megalite.training.pretrain import pretrain
from tests.harness import run_distributed
from tests.training.common import FAMILIES, assert_close_rel, config

REL = 1e-5
FOUR_LAYERS = ["--num-layers", "4", "--train-iters", "4"]
GRID = "--tensor-parallel-mode 2d --tensor-model-parallel-size 4 --pipeline-model-parallel-size 2"


def _train_case(root: str, cases: list[tuple[str, list[str]]]) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    env = {"RANK": str(rank), "WORLD_SIZE": str(world)}
    out = {}
    for name, extra in cases:
        save = os.path.join(root, name)
        flags = [*extra, *FOUR_LAYERS, "--save", save, "--save-interval", "2", *GRID.split()]
        straight = pretrain(config(*flags, world_size=world, rank=rank), env=env)
        tp2 = [*extra, *FOUR_LAYERS, "--tensor-model-parallel-size", "2"]
        tp2 += ["--load", save, "--ckpt-step", "2"]
        resharded = pretrain(config(*tp2, world_size=world, rank=rank), env=env)
        out[name] = (straight.losses, resharded.losses, resharded.iteration)
    return out


def test_save_2d_tp4_pp2_continue_at_1d_tp2_dp4_and_one_process():
    cases = [
        ("gpt2_plain", FAMILIES["gpt2"]),
        ("llama_zero1", [*FAMILIES["llama"], "--use-distributed-optimizer"]),
    ]
    with tempfile.TemporaryDirectory() as root:
        results = run_distributed(_train_case, 8, root, cases, timeout=600)
        for name, extra in cases:
            straight, resharded, iteration = results[7][name]  # last stage of both layouts
            unresharded = straight[2:]
            assert len(straight) == 4 and iteration == 4
            assert_close_rel(resharded, unresharded, REL, f"{name} at 1d TP2 x DP4")
            plain = [f for f in extra if f != "--use-distributed-optimizer"]
            single_flags = [*plain, *FOUR_LAYERS, "--load", os.path.join(root, name)]
            single_flags += ["--ckpt-step", "2"]
            single = pretrain(config(*single_flags), env={}).losses
            assert_close_rel(single, unresharded, REL, f"{name} in one process")
        fresh = pretrain(config(*single_flags, "--no-load-optim"), env={}).losses
        gap = max(abs(a - b) / abs(b) for a, b in zip(fresh, unresharded))
        assert gap > 10 * REL, f"the optimizer state makes no difference ({gap}): vacuous test"


CUBE = "--tensor-parallel-mode 3d --tensor-model-parallel-size 8 --micro-batch-size 4"
GPT2_ZERO1 = [*FAMILIES["gpt2"], "--use-distributed-optimizer", "--train-iters", "4"]


def _cube_case(save: str) -> tuple[list[float], list[float], int]:
    rank, world = dist.get_rank(), dist.get_world_size()
    env = {"RANK": str(rank), "WORLD_SIZE": str(world)}
    flags = [*GPT2_ZERO1, "--save", save, "--save-interval", "2", *CUBE.split()]
    straight = pretrain(config(*flags, world_size=world, rank=rank), env=env)
    tp2 = [*GPT2_ZERO1, "--tensor-model-parallel-size", "2", "--load", save, "--ckpt-step", "2"]
    resharded = pretrain(config(*tp2, world_size=world, rank=rank), env=env)
    return straight.losses, resharded.losses, resharded.iteration


def test_save_3d_tp8_continue_at_1d_tp2_dp4_and_one_process():
    with tempfile.TemporaryDirectory() as root:
        save = os.path.join(root, "gpt2_cube")
        straight, resharded, iteration = run_distributed(_cube_case, 8, save, timeout=600)[7]
        assert len(straight) == 4 and iteration == 4
        assert_close_rel(resharded, straight[2:], REL, "3d TP8 continued at 1d TP2 x DP4")
        plain = [f for f in GPT2_ZERO1 if f != "--use-distributed-optimizer"]
        single = pretrain(config(*plain, "--load", save, "--ckpt-step", "2"), env={}).losses
        assert_close_rel(single, straight[2:], REL, "3d TP8 continued in one process")

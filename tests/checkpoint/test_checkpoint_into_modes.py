"""A checkpoint saved under 1d (or in one process) continues under every grid tensor-parallel mode.

The 2-layer model trains to iteration 4, saving at 2 (the unresharded continuation). From that
checkpoint each grid layout runs iterations 3-4 on 8 ranks: losses within 1e-5 relative of the
unresharded ones (fp32; only the order of sums differs). The model and the Adam state go through
the logical form (``tp_shards``): merged from the saved layout, cut into the grid's blocks.

- GPT-2 (tied output layer in the word table's grid blocks), ZeRO-1 on both sides: saved at 1d
  TP 2 x DP 4, continued at 3d TP 8 (q = 2) and at 2d TP 4 x DP 2.
- Llama (SwiGLU's strided fc1, GQA, untied output), the plain optimizer: saved in one process,
  continued at 2.5d TP 8 (d = 2, q = 2) and at 3d TP 8.
"""

from __future__ import annotations

import os
import tempfile

import torch.distributed as dist

from megalite.training.pretrain import pretrain
from tests.harness import run_distributed
from tests.training.common import FAMILIES, assert_close_rel, config

REL = 1e-5
FOUR_STEPS = ["--train-iters", "4"]
GRIDS = {  # a micro-batch of 4: d x q = q^2 = 4 blocks of whole sequences
    "3d TP8": "--tensor-parallel-mode 3d --tensor-model-parallel-size 8 --micro-batch-size 4",
    "2d TP4 x DP2": "--tensor-parallel-mode 2d --tensor-model-parallel-size 4 --micro-batch-size 4",
    "2.5d TP8": "--tensor-parallel-mode 2.5d --tensor-parallel-depth 2 "
    "--tensor-model-parallel-size 8 --micro-batch-size 4",
}
GPT2 = [*FAMILIES["gpt2"], "--use-distributed-optimizer", *FOUR_STEPS]
LLAMA = [*FAMILIES["llama"], *FOUR_STEPS]


def _run(*flags: str):
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = config(*flags, world_size=world, rank=rank)
    return pretrain(cfg, env={"RANK": str(rank), "WORLD_SIZE": str(world)})


def _continue(save: str, family: list[str], grids: list[str]) -> dict:
    """Iterations 3-4 from ``save``'s iteration 2 under each of ``grids``: their losses."""
    out = {}
    for grid in grids:
        result = _run(*family, "--load", save, "--ckpt-step", "2", *GRIDS[grid].split())
        out[grid] = (result.losses, result.iteration)
    return out


def _gpt2_case(root: str) -> tuple[list[float], dict]:
    save = os.path.join(root, "gpt2")
    tp2 = ["--tensor-model-parallel-size", "2", "--save", save, "--save-interval", "2"]
    straight = _run(*GPT2, *tp2).losses
    return straight, _continue(save, GPT2, ["3d TP8", "2d TP4 x DP2"])


def _check(straight: list[float], resumed: dict, what: str) -> None:
    assert len(straight) == 4, straight
    for grid, (losses, iteration) in resumed.items():
        assert iteration == 4, (what, grid, iteration)
        assert_close_rel(losses, straight[2:], REL, f"{what} continued at {grid}")


def test_save_1d_tp2_dp4_continue_at_3d_tp8_and_2d_tp4():
    with tempfile.TemporaryDirectory() as root:
        results = run_distributed(_gpt2_case, 8, root, timeout=600)
        straight, resumed = results[7]
        _check(straight, resumed, "GPT-2 saved at 1d TP2 x DP4")


def test_save_in_one_process_continue_at_2_5d_tp8_and_3d_tp8():
    with tempfile.TemporaryDirectory() as root:
        save = os.path.join(root, "llama")
        flags = [*LLAMA, "--save", save, "--save-interval", "2"]
        straight = pretrain(config(*flags), env={}).losses
        results = run_distributed(_continue, 8, save, LLAMA, ["2.5d TP8", "3d TP8"], timeout=600)
        _check(straight, results[7], "Llama saved in one process")

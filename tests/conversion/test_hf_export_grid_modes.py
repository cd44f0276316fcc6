"""HF export of a checkpoint saved under a grid tensor-parallel mode (2d TP 4, q = 2, 4 ranks).

Both families train 2 iterations at 2d TP 4 and save; the same flags in one process are the
oracle. ``load_model`` of the grid checkpoint (its blocks merged by ``tp_shards``) gives the
oracle's weights within 1e-5 absolute (the layouts differ in the order of sums only, ~1e-6 after
2 Adam steps, while a misplaced block moves weights by >= 1e-3), and the exported HF model's
logits equal the one-process megalite model's within 1e-4 (``tests/conversion``' bar: op order
only; a wrong layout moves logits of size ~0.5 by far more). Megatron's formats are refused from
the grid checkpoint in one line that names the mode and the fix.
"""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist

from megalite import load_model
from megalite.checkpoint.files import CheckpointError, iteration_dir
from megalite.checkpoint.megatron import convert_to_megatron
from megalite.conversion import export_to_hf, hf_logit_difference
from megalite.training.pretrain import pretrain
from tests.harness import run_distributed
from tests.training.common import FAMILIES, config

pytest.importorskip("transformers")

FLAGS = ["--vocab-size", "100", "--train-iters", "2"]
GRID = ["--tensor-parallel-mode", "2d", "--tensor-model-parallel-size", "4"]


def _train_case(root: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    for family, flags in FAMILIES.items():
        save = os.path.join(root, family)
        cfg = config(*flags, *FLAGS, *GRID, "--save", save, world_size=world, rank=rank)
        pretrain(cfg, env={"RANK": str(rank), "WORLD_SIZE": str(world)})


def test_trained_at_2d_tp4_exports_to_hf_with_the_one_process_logits(tmp_path):
    root = str(tmp_path)
    run_distributed(_train_case, 4, root, timeout=600)
    for family, flags in FAMILIES.items():
        oracle = os.path.join(root, family + "_oracle")
        pretrain(config(*flags, *FLAGS, "--save", oracle), env={})
        reference = load_model(oracle)
        model = load_model(os.path.join(root, family))
        assert model.checkpoint_info["layout"]["tp_mode"] == "2d"
        for name, want in reference.state_dict().items():
            assert (model.state_dict()[name] - want).abs().max() < 1e-5, (family, name)
        hf_dir = os.path.join(root, family + "_hf")
        export_to_hf(os.path.join(root, family), hf_dir)
        assert hf_logit_difference(hf_dir, reference) < 1e-4, family

        grid_iter = iteration_dir(os.path.join(root, family), 2)
        with pytest.raises(CheckpointError) as err:
            convert_to_megatron(grid_iter, os.path.join(root, family + "_megatron"), "torch")
        message = str(err.value)
        assert "tensor_parallel_mode 2d does not combine with ckpt_format torch" in message
        assert "use ckpt_format megalite" in message and "\n" not in message

"""HF export of a checkpoint saved under each grid tensor-parallel mode: 2d TP 4 (2 x 2, 4 ranks),
2.5d TP 8 (depth 2 x 2 x 2) and 3d TP 8 (2 x 2 x 2), the last two in one 8-rank launch.

Both families train 2 iterations under each mode and save; the same flags in one process are the
oracle (micro-batches of 4 sequences, which 2.5d's and 3d's 4 batch blocks need). ``load_model``
of the grid checkpoint (its blocks merged by ``tp_shards``) gives the oracle's weights within
1e-5 absolute (the layouts differ in the order of sums only, ~1e-6 after 2 Adam steps, while a
misplaced block moves weights by >= 1e-3), and the exported HF model's logits equal the
one-process megalite model's within 1e-4 (``tests/conversion``' bar: op order only; a wrong
layout moves logits of size ~0.5 by far more). Megatron's formats are refused from the grid
checkpoint in one line that names the mode and the fix.
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

FLAGS = ["--vocab-size", "100", "--train-iters", "2", "--micro-batch-size", "4"]
MODES = {  # mode -> (world size, its flags)
    "2d": (4, "--tensor-parallel-mode 2d --tensor-model-parallel-size 4"),
    "2.5d": (
        8,
        "--tensor-parallel-mode 2.5d --tensor-model-parallel-size 8 --tensor-parallel-depth 2",
    ),
    "3d": (8, "--tensor-parallel-mode 3d --tensor-model-parallel-size 8"),
}


def _train_case(root: str, modes: list[str]) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    for mode in modes:
        for family, flags in FAMILIES.items():
            save = os.path.join(root, mode, family)
            extra = [*flags, *FLAGS, *MODES[mode][1].split(), "--save", save]
            cfg = config(*extra, world_size=world, rank=rank)
            pretrain(cfg, env={"RANK": str(rank), "WORLD_SIZE": str(world)})


def test_trained_under_each_grid_mode_exports_to_hf_with_the_one_process_logits(tmp_path):
    root = str(tmp_path)
    for world in sorted({w for w, _ in MODES.values()}):
        modes = [mode for mode, (w, _) in MODES.items() if w == world]
        run_distributed(_train_case, world, root, modes, timeout=600)
    for family, flags in FAMILIES.items():
        oracle = os.path.join(root, family + "_oracle")
        pretrain(config(*flags, *FLAGS, "--save", oracle), env={})
        reference = load_model(oracle)
        for mode in MODES:
            what = (family, mode)
            saved = os.path.join(root, mode, family)
            model = load_model(saved)
            assert model.checkpoint_info["layout"]["tp_mode"] == mode, what
            for name, want in reference.state_dict().items():
                assert (model.state_dict()[name] - want).abs().max() < 1e-5, (*what, name)
            hf_dir = saved + "_hf"
            export_to_hf(saved, hf_dir)
            assert hf_logit_difference(hf_dir, reference) < 1e-4, what

            with pytest.raises(CheckpointError) as err:
                convert_to_megatron(iteration_dir(saved, 2), saved + "_megatron", "torch")
            message = str(err.value)
            assert f"tensor_parallel_mode {mode} does not combine with ckpt_format torch" in message
            assert "use ckpt_format megalite" in message and "\n" not in message

"""The planner's memory model under the grid and cube tensor-parallel modes, against a real step
on CPU: model-state bytes (every parameter as the mode splits it, grads, Adam state) equal
``core.optimizer.memory_report``'s measurement byte for byte on every rank, and the saved
activations of one training step (``SavedTensorMeter``) are within 5% of
``planning.activations`` (``mode_activations``' formulas): 2d at TP 4 and 3d at TP 8 (q = 2),
both families. ``test_tp_modes.py`` holds a single layer's bytes to the same formulas exactly.
"""

from __future__ import annotations

import torch.distributed as dist

from megalite.planning.mode_activations import mode_layer_bytes
from megalite.planning.tp_split import TPSplit
from megalite.training.pretrain import mesh_for
from tests.harness import run_distributed
from tests.planning.test_memory_prediction import LLAMA, _check, _measure
from tests.planning.test_tp_modes import CASES, FAMILY, B, S, _config, _saved_case
from tests.training.common import config

GRID4 = {
    "2d TP4 gpt2": ("--tensor-model-parallel-size", "4", "--tensor-parallel-mode", "2d"),
    "2d TP4 llama": (*LLAMA, "--tensor-model-parallel-size", "4", "--tensor-parallel-mode", "2d"),
}
CUBE8 = {
    "3d TP8 gpt2": ("--tensor-model-parallel-size", "8", "--tensor-parallel-mode", "3d",
                    "--micro-batch-size", "4"),
    "3d TP8 llama": (*LLAMA, "--tensor-model-parallel-size", "8", "--tensor-parallel-mode", "3d",
                     "--micro-batch-size", "4"),
}  # fmt: skip


def _world_case(cases: dict) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for name, flags in cases.items():
        cfg = config(*flags, world_size=world, rank=rank)
        ps = mesh_for(cfg.parallel)
        try:
            out[name] = _measure(cfg, ps)
        finally:
            ps.destroy()
    return out


def test_2d_tp4_prediction_matches():
    for rank, per_rank in enumerate(run_distributed(_world_case, 4, GRID4, timeout=600)):
        for name in GRID4:
            _check(name, rank, *per_rank[name])


def test_3d_tp8_prediction_matches():
    for rank, per_rank in enumerate(run_distributed(_world_case, 8, CUBE8, timeout=600)):
        for name in CUBE8:
            _check(name, rank, *per_rank[name])


def test_layer_saved_bytes_are_the_closed_form():
    """One layer's forward under each grid and the cube saves exactly ``mode_layer_bytes``."""
    for family in sorted(FAMILY):
        c = _config(family)
        for case in ("2d", "2.5d", "3d"):
            mode, tp, depth = CASES[case]
            expected = mode_layer_bytes(
                c,
                TPSplit(mode, tp, depth),
                tokens=S * B,
                b=B,
                e=4,
                selective=False,
                mask_bytes=4,
                cpu=True,
                fused_softmax=False,
            )
            got = run_distributed(_saved_case, tp, family, mode, tp, depth)
            assert got == [expected] * tp, (family, case, got, expected)

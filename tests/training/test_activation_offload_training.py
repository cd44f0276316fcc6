"""Activation offload in the real loop: 5 steps with ``--cpu-offloading`` equal 5 steps without.

The offloaded saved tensors are exact copies and backward reads them instead of the originals,
so the runs are bit-identical: the test asserts equal losses and grad norms (tighter than the
1e-6 relative the equivalence contract allows). Layouts: DP2, TP2 x DP2 with sequence parallel,
PP2 x DP2, both families, fp32; bf16 against bf16 without offload (DP2); full recompute (the
checkpointed layer inputs move) against full recompute without offload (DP2). Each run also
reports how many tensors its chunks moved, so a setting that offloaded nothing would fail.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from megalite.errors import ConfigError
from megalite.training.forward_step import make_forward_step
from tests.harness import run_distributed
from tests.mesh import mesh
from tests.training.common import FAMILIES, config, trainer_and_data

OFFLOAD = ("--cpu-offloading", "--cpu-offloading-num-layers")
FULL = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1".split()


def _run(extra: list[str], tp: int, pp: int) -> tuple[list[float], list[float], int]:
    """Losses, grad norms and the tensors the rank's chunks moved to the host."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = config(*extra, world_size=world, rank=rank)
    ps = mesh(tp, pp)
    try:
        trainer, data = trainer_and_data(cfg, ps)
        result = trainer.train(make_forward_step(trainer.device), data)
    finally:
        ps.destroy()
    moved = 0
    for chunk in trainer.model:
        offload = chunk.module.decoder.activation_offload
        moved += 0 if offload is None else sum(offload.moved_tensors.values())
    return result.losses, result.grad_norms, moved


def _case(layouts: list[tuple[str, list[str], int, int, int]]) -> dict:
    """Per layout (name, flags, tp, pp, N): the run without offload and the run with N layers."""
    out = {}
    for name, flags, tp, pp, n in layouts:
        parallel = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size"]
        parallel.append(str(pp))
        if tp > 1:
            parallel.append("--sequence-parallel")
        plain = _run([*flags, *parallel], tp, pp)
        offloaded = _run([*flags, *parallel, *OFFLOAD, str(n)], tp, pp)
        out[name] = (plain, offloaded)
    return out


def _check(results: list[dict]) -> None:
    for rank, runs in enumerate(results):
        for name, ((losses, norms, moved), (o_losses, o_norms, o_moved)) in runs.items():
            assert moved == 0 and o_moved > 0, (name, rank, moved, o_moved)
            assert o_losses == losses, (name, rank, o_losses, losses)
            assert o_norms == norms, (name, rank, o_norms, norms)
            if losses:  # the last stage logs them; the run trains
                assert losses[-1] < losses[0], (name, losses)


def test_dp2_fp32_bf16_and_full_recompute_equal_no_offload():
    layouts = [(f"{f} dp2", FAMILIES[f], 1, 1, 2) for f in FAMILIES]
    layouts.append(("gpt2 dp2 bf16", ["--bf16"], 1, 1, 2))
    layouts.append(("llama dp2 bf16", [*FAMILIES["llama"], "--bf16"], 1, 1, 1))
    layouts.append(("llama dp2 full recompute", [*FAMILIES["llama"], *FULL], 1, 1, 1))
    _check(run_distributed(_case, 2, layouts, timeout=600))


def test_tp2_sp_dp2_and_pp2_dp2_equal_no_offload():
    layouts = [(f"{f} tp2 sp dp2", FAMILIES[f], 2, 1, 1) for f in FAMILIES]
    layouts += [(f"{f} pp2 dp2", FAMILIES[f], 1, 2, 1) for f in FAMILIES]
    _check(run_distributed(_case, 4, layouts, timeout=600))


def test_bad_num_layers_name_the_flags():
    with pytest.raises(ConfigError, match="--cpu-offloading-num-layers must be an integer >= 0"):
        config("--cpu-offloading", "--cpu-offloading-num-layers", "-1")
    pp2 = ["--pipeline-model-parallel-size", "2", "--num-layers", "4"]
    with pytest.raises(ConfigError, match="--cpu-offloading-num-layers 3 exceeds the 2 layers"):
        config(*pp2, "--cpu-offloading", "--cpu-offloading-num-layers", "3", world_size=2)

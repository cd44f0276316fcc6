"""MoE training in Megatron's other rank order, ``--use-tp-pp-dp-mapping`` (tp-cp-ep-pp-dp), where
the expert view shares the dense view's pipeline groups only when tp x cp = etp x ep.

- World 4, PP 2, EP 2 (tp x cp = 1, etp x ep = 2): the expert groups would span two stages (the
  run used to hang after its start-up report); the flags are refused in one line, and so is the
  mesh itself on 4 ranks, before any process group (a 60 s timeout makes a hang fail fast).
- World 4, CP 2 x PP 2 x EP 2 in that order (tp x cp = 2 = etp x ep; pipelines [[0, 2], [1, 3]] in
  both views): the 5 losses, grad norms, load-balancing and z losses equal the single process's
  (fp32, 1e-5 relative: CP, EP and the norm's squares sum in another order).
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from megalite.core.parallel_state import ParallelState
from megalite.training.config import ConfigError
from megalite.training.pretrain import mesh_for
from tests.harness import run_distributed
from tests.mesh import mesh
from tests.training.common import assert_close_rel, config, train_losses

REL = 1e-5
MOE = (
    "--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 16 --moe-aux-loss-coeff 0.01 "
    "--moe-z-loss-coeff 0.001 --moe-token-dispatcher-type alltoall --log-interval 1 "
    "--num-layers 4"
).split()
MAPPING = ("--use-tp-pp-dp-mapping", "--pipeline-model-parallel-size", "2")
SPLIT = (*MAPPING, "--expert-model-parallel-size", "2")  # world 4: refused
FOLDED = (*SPLIT, "--context-parallel-size", "2")  # world 4: the views share the pipelines


def _summary(result) -> tuple[list[float], ...]:
    aux = [m["load_balancing_loss"] for m in result.moe_losses]
    z = [m["z_loss"] for m in result.moe_losses]
    return result.losses, result.grad_norms, aux, z


def test_split_pipeline_layout_is_refused_in_one_line_by_the_flags():
    with pytest.raises(ConfigError) as e:
        config(*MOE, *SPLIT, world_size=4)
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith(
        "--use-tp-pp-dp-mapping: rank order tp-cp-ep-pp-dp with --pipeline-model-parallel-size 2 "
        "splits pipeline stages: they are --tensor-model-parallel-size 1 x "
        "--context-parallel-size 1 = 1 ranks apart in the dense view but "
        "--expert-tensor-parallel-size 1 x --expert-model-parallel-size 2 = 2"
    ), message


def _mesh_case() -> str:
    try:
        mesh(pp=2, ep=2, order="tp-cp-ep-pp-dp")
    except ValueError as e:
        return str(e)
    return "built"


def test_split_pipeline_mesh_is_refused_on_every_rank_before_any_group():
    results = run_distributed(_mesh_case, 4, timeout=600)
    assert len(set(results)) == 1 and "splits pipeline stages" in results[0], results


def _folded_case() -> tuple:
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = config(*MOE, *FOLDED, world_size=world, rank=rank)
    ps = mesh_for(cfg.parallel)
    try:
        assert ps.order == "tp-cp-ep-pp-dp"
        groups = (ps.ranks("pp"), ps.ranks("ep"), ps.ranks("cp"))
        return ps.is_last_stage, groups, _summary(train_losses(cfg, ps))
    finally:
        ps.destroy()


def test_moe_in_tp_pp_dp_order_at_cp2_ep2_pp2_equals_one_process():
    losses, norms, aux, z = _summary(train_losses(config(*MOE), ParallelState.single()))
    assert max(losses) - min(losses) > 1e-4 and min(aux) > 0, "vacuous oracle"
    results = run_distributed(_folded_case, 4, timeout=600)
    for rank, (is_last, groups, (got_losses, got_norms, got_aux, got_z)) in enumerate(results):
        assert groups[0] == [rank % 2, rank % 2 + 2]  # stages 2 ranks apart in both views
        assert groups[1] == groups[2] == [rank // 2 * 2, rank // 2 * 2 + 1]
        what = f"rank {rank}"
        assert_close_rel(got_norms, norms, REL, what + " grad norm")
        assert_close_rel(got_aux, aux, REL, what + " load-balancing loss")
        assert_close_rel(got_z, z, REL, what + " z loss")
        if is_last:
            assert_close_rel(got_losses, losses, REL, what + " loss")

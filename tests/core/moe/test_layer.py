"""The MoE layer (router + dispatch + experts) at EP {1, 2, 4} x ETP {1, 2}, both dispatchers,
dropless and with capacity: output and every grad = the single-process layer of the same seed.

Every rank holds its own tokens; the oracle is the same layer built with ``ParallelState.single()``
applied to each rank's tokens in turn. The capacity is per rank's tokens (Megatron's), so the
oracle runs shard by shard; an expert's grad is the oracle's summed over the shards of the ranks
in its ETP x EP group, sliced with ``chunk``. fp32, 1e-5 relative (reduction order only).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from megalite.core.parallel_state import ParallelState
from tests.core.moe.cases import (
    build_layer,
    expected_expert_grads,
    moe_config,
    run_layer,
    shard_inputs,
)
from tests.harness import run_distributed
from tests.mesh import mesh

LAYOUTS = [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (4, 2)]  # (EP, ETP) in a world of 8
CONFIGS = {
    "alltoall dropless": dict(),
    "allgather dropless swiglu grouped": dict(
        token_dispatcher_type="allgather", swiglu=True, grouped_gemm=True
    ),
    "alltoall capacity padded position grouped sigmoid bias": dict(
        expert_capacity_factor=0.8,
        pad_expert_input_to_capacity=True,
        token_drop_policy="position",
        grouped_gemm=True,
        router_score_function="sigmoid",
        router_enable_expert_bias=True,
    ),
    "allgather capacity probs pre-softmax top-1 seq-aux swiglu": dict(
        token_dispatcher_type="allgather",
        expert_capacity_factor=1.0,
        router_pre_softmax=True,
        router_topk=1,
        router_load_balancing_type="seq_aux_loss",
        swiglu=True,
    ),
}


def close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Max abs difference <= 1e-5 x the expected tensor's largest entry (fp32 sum order)."""
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    err, scale = (actual - expected).abs().max().item(), expected.abs().max().item()
    assert err <= 1e-5 * scale + 1e-12, f"{what}: max diff {err:.3g} vs scale {scale:.3g}"


def _layer_cases(configs: dict, layouts: list) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    checked = 0
    for name, overrides in configs.items():
        config = moe_config(**overrides)
        oracle_layer = build_layer(dataclasses.replace(config), ParallelState.single())
        if config.router_enable_expert_bias:
            oracle_layer.router.expert_bias.copy_(torch.linspace(-0.2, 0.2, config.num_experts))
        oracle = {r: run_layer(oracle_layer, *shard_inputs(r)) for r in range(world)}
        for ep, etp in layouts:
            ps = mesh(1, 1, ep=ep, etp=etp)
            layer = build_layer(config, ps)
            if config.router_enable_expert_bias:
                layer.router.expert_bias.copy_(oracle_layer.router.expert_bias)
            got = run_layer(layer, *shard_inputs(rank))
            what = f"{name} EP{ep} ETP{etp} rank {rank}"
            for key in ("out", "x", "router"):
                close(got[key], oracle[rank][key], f"{what} {key}")
            w1, w2 = expected_expert_grads(oracle, ps.ranks("etp", "ep"), ps, config)
            close(got["w1"], w1, f"{what} w1 grad")
            close(got["w2"], w2, f"{what} w2 grad")
            ps.destroy()
            checked += 1
    return checked


def test_moe_layer_matches_single_process_across_ep_etp_and_dispatchers():
    results = run_distributed(_layer_cases, 8, CONFIGS, LAYOUTS)
    assert results == [len(CONFIGS) * len(LAYOUTS)] * 8

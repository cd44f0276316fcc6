"""Shared pieces of the MoE layer tests: a tiny MoE layer built on a mesh, and its oracle."""

from __future__ import annotations

import dataclasses

import torch

from megalite.core.moe import MoEConfig, MoELayer
from megalite.core.moe.experts import shard_rows
from megalite.core.parallel_state import ParallelState
from megalite.core.tensor_parallel.init import init_normal

H, E, F, TOPK, S, B = 16, 8, 8, 2, 6, 2


def moe_config(**overrides) -> MoEConfig:
    base = MoEConfig(
        num_experts=E,
        hidden_size=H,
        ffn_hidden_size=F,
        router_topk=TOPK,
        aux_loss_coeff=0.01,
        z_loss_coeff=0.001,
        init_method_std=0.3,
    )
    return dataclasses.replace(base, **overrides)


def build_layer(config: MoEConfig, ps: ParallelState, *, sequence_parallel: bool = False):
    def init(key):
        return init_normal(0.3, seed=5, key=key)

    return MoELayer(
        config,
        tp_group=ps.tp_group,
        seq_group=ps.group("tp", "cp"),
        cp_size=ps.cp_size,
        ep_group=ps.group("ep"),
        ep_rank=ps.rank("ep"),
        etp_group=ps.group("etp"),
        expert_group=ps.group("etp", "ep"),
        sequence_parallel=sequence_parallel,
        init_router=init("router"),
        init_fc1=lambda e: init(f"fc1.{e}"),
        init_fc2=lambda e: init(f"fc2.{e}"),
    )


def shard_inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s tokens # [S, B, H] and the weights of its loss (a fixed function of rank)."""
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(S, B, H, generator=g), torch.randn(S, B, H, generator=g)


def run_layer(layer: MoELayer, x: torch.Tensor, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Forward + backward of ``(layer(x) * w).sum()``; the output and every grad."""
    layer.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    out = layer(x)
    (out * w).sum().backward()
    return {
        "out": out.detach(),
        "x": x.grad,
        "router": layer.router.weight.grad.clone(),
        "w1": layer.experts.weight1.grad.clone(),
        "w2": layer.experts.weight2.grad.clone(),
    }


def expected_expert_grads(oracle: dict[int, dict], ranks: list[int], ps: ParallelState, config):
    """The oracle's expert grads summed over the shards of ``ranks``, sliced to this rank's experts
    (EP: dim 0) and ffn slice (ETP: chunk, stride 2 under SwiGLU)."""
    el = config.num_experts // ps.size("ep")
    lo = ps.rank("ep") * el
    etp, etp_rank = ps.size("etp"), ps.rank("etp")
    w1 = sum(oracle[r]["w1"] for r in ranks)[lo : lo + el]
    w2 = sum(oracle[r]["w2"] for r in ranks)[lo : lo + el]
    stride = 2 if config.swiglu else 1
    return (
        shard_rows(w1, 1, stride=stride, size=etp, rank=etp_rank),
        shard_rows(w2, 2, stride=1, size=etp, rank=etp_rank),
    )

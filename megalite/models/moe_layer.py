"""The MoE MLP of a transformer layer: the core ``MoELayer`` built from a ``GPTConfig`` and the
mesh, plus optional shared experts (a dense MLP every token goes through, Qwen2-MoE's with a
sigmoid gate). ``build_mlp`` picks it or the dense ``MLP`` per layer (``moe_layer_freq``).

State-dict names under ``decoder.layers.{i}.mlp``: ``router.weight`` # [E, h],
``router.expert_bias`` # [E] (with the expert bias), ``experts.weight1`` # [E_local, f1/etp, h],
``experts.weight2`` # [E_local, h, f/etp], ``shared_experts.linear_fc1/linear_fc2.*``,
``shared_experts_gate.weight`` # [1, h]. Inits are keyed by the global layer and expert index.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from megalite.core.moe.layer import MoELayer
from megalite.core.moe.router import routers_of
from megalite.core.parallel_state import ParallelState
from megalite.models.common import weight_init
from megalite.models.config import GPTConfig
from megalite.models.mlp import MLP
from megalite.models.moe_config import moe_config, moe_layer_pattern


class MoEMLP(MoELayer):
    """Input and output # [s, b, h] ([s/tp, b, h] under sequence parallel)."""

    def __init__(
        self,
        config: GPTConfig,
        ps: ParallelState,
        *,
        layer_number: int,
        device: torch.device | None = None,
    ):
        prefix = f"decoder.layers.{layer_number}.mlp"
        super().__init__(
            moe_config(config),
            tp_group=ps.tp_group,
            seq_group=ps.group("tp", "cp"),
            batch_group=ps.group("tp", "cp", "dp"),
            cp_size=ps.cp_size,
            ep_group=ps.group("ep"),
            ep_rank=ps.rank("ep"),
            etp_group=ps.group("etp"),
            expert_group=ps.group("etp", "ep"),
            sequence_parallel=config.sequence_parallel,
            init_router=weight_init(config, f"{prefix}.router.weight"),
            init_fc1=lambda e: weight_init(config, f"{prefix}.experts.{e}.linear_fc1.weight"),
            init_fc2=lambda e: weight_init(
                config, f"{prefix}.experts.{e}.linear_fc2.weight", scaled=True
            ),
            device=device,
        )
        self.router.layer_number = layer_number  # for read_moe_stats
        self.shared_experts = self.shared_experts_gate = None
        shared = config.moe_shared_expert_intermediate_size
        if shared is not None:
            shared_config = dataclasses.replace(config, ffn_hidden_size=shared, num_experts=None)
            self.shared_experts = MLP(shared_config, ps, layer_number=layer_number, device=device)
            if config.moe_shared_expert_gate:
                self.shared_experts_gate = nn.Linear(
                    config.hidden_size, 1, bias=False, device=device, dtype=config.params_dtype
                )
                weight_init(config, f"{prefix}.shared_experts_gate.weight")(
                    self.shared_experts_gate.weight
                )
                self.shared_experts_gate.weight.sequence_parallel = config.sequence_parallel

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = super().forward(hidden)
        if self.shared_experts is not None:
            shared = self.shared_experts(hidden)
            if self.shared_experts_gate is not None:
                shared = torch.sigmoid(F.linear(hidden, self.shared_experts_gate.weight)) * shared
            out = out + shared
        return out


def build_mlp(
    config: GPTConfig,
    ps: ParallelState,
    *,
    layer_number: int,
    device: torch.device | None = None,
) -> nn.Module:
    """Global layer ``layer_number``'s MLP: MoE where ``moe_layer_pattern`` says so, else dense."""
    if moe_layer_pattern(config)[layer_number]:
        return MoEMLP(config, ps, layer_number=layer_number, device=device)
    return MLP(config, ps, layer_number=layer_number, device=device)


def read_moe_stats(model: nn.Module | list[nn.Module], ps: ParallelState, num_layers: int):
    """The MoE numbers since the last read, every rank's (collective over the world: one
    all-reduce), then restarted. Returns ``{global layer: (aux loss, z loss, tokens per expert
    # [E])}`` for the MoE layers: each loss the mean over the interval's micro-batches of the
    micro-batch's loss (coefficient included), the counts summed over the global batches."""
    routers = routers_of(model)
    width = max([r.stats.numel() for r in routers], default=0)
    owned = torch.zeros(num_layers, dtype=torch.bool)
    for r in routers:
        owned[r.layer_number] = True
    width_t = torch.tensor([width, *owned.tolist()], dtype=torch.float64, device=ps.device)
    if ps.world_size > 1:  # every rank learns E and which layers are MoE
        torch.distributed.all_reduce(width_t, op=torch.distributed.ReduceOp.MAX, group=ps.group())
    width, owned = int(width_t[0].item()), width_t[1:].bool().tolist()
    if width == 0:
        return {}
    table = torch.zeros(num_layers, width, dtype=torch.float64, device=ps.device)
    for r in routers:
        table[r.layer_number] = r.stats.double()
        r.stats.zero_()
    if ps.world_size > 1:
        torch.distributed.all_reduce(table, group=ps.group())
    out = {}
    for layer in range(num_layers):
        row = table[layer]
        if not owned[layer] or row[2] == 0:
            continue
        # sum of partials over tp x cp x dp and micro-batches; row[2] counts micro-batches x tp x cp
        per_mb = ps.tp_size / row[2].item()
        out[layer] = (row[0].item() * per_mb, row[1].item() * per_mb, row[3:].cpu())
    return out

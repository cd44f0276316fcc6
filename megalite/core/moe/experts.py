"""The experts of one EP rank: ``E_local`` MLPs, each sharded over the expert-TP group.

Weights are stacked per local expert: ``weight1`` # [E_local, f1/etp, h] (``f1`` = 2f under SwiGLU,
the full ``[gate; up]`` rows of each expert split with stride 2 like ``MLP``'s ``linear_fc1``) and
``weight2`` # [E_local, h, f/etp]. Local expert ``i`` of EP rank ``r`` is global expert
``r * E_local + i``; each expert's full weight is initialised from its global index's key, so the
numbers do not depend on EP or ETP. Without bias (as Mixtral and Qwen2-MoE).

Input: tokens grouped by local expert, # [N, h] with ``counts[i]`` rows for expert i. Output
# [N, h], a partial sum over the ETP group (each rank holds a slice of the ffn dim).

``grouped_gemm``: one batched kernel per linear over all experts (tokens padded per expert to the
largest count, ``torch.bmm``; ``torch._grouped_mm`` on CUDA in bf16 where torch has it); else a
loop of one matmul per expert. Both compute the same numbers.

Every weight carries ``expert_parallel = True`` (its grad is reduced over the expert-data-parallel
group, not the dense one) and ``tensor_model_parallel = True`` (distinct on every rank of the
expert-model-parallel group).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megalite.core.groups import group_rank, group_size
from megalite.core.moe.config import MoEConfig


def shard_rows(full: torch.Tensor, dim: int, *, stride: int, size: int, rank: int) -> torch.Tensor:
    """This rank's part of ``full`` along ``dim`` (``stride`` stacked blocks, each split)."""
    blocks = full.chunk(stride, dim=dim)
    return torch.cat([b.chunk(size, dim=dim)[rank] for b in blocks], dim=dim)


class GroupedExperts(nn.Module):
    """See the module docstring. ``init_fc1(e)`` / ``init_fc2(e)``: the init of global expert
    ``e``'s full ``[f1, h]`` / ``[h, f]`` weight."""

    def __init__(
        self,
        config: MoEConfig,
        *,
        ep_rank: int,
        ep_size: int,
        etp_group,
        init_fc1,
        init_fc2,
        device: torch.device | None = None,
    ):
        super().__init__()
        self.config = config
        self.num_local_experts = config.num_experts // ep_size
        self.swiglu, self.openai_gelu = config.swiglu, config.openai_gelu
        self.grouped_gemm = config.grouped_gemm
        etp, etp_rank = group_size(etp_group), group_rank(etp_group)
        f, h = config.ffn_hidden_size, config.hidden_size
        f1, stride = (2 * f, 2) if self.swiglu else (f, 1)
        w1, w2 = [], []
        for i in range(self.num_local_experts):
            e = ep_rank * self.num_local_experts + i
            full1 = torch.empty(f1, h)
            init_fc1(e)(full1)
            full2 = torch.empty(h, f)
            init_fc2(e)(full2)
            w1.append(shard_rows(full1, 0, stride=stride, size=etp, rank=etp_rank))
            w2.append(shard_rows(full2, 1, stride=1, size=etp, rank=etp_rank))
        kw = dict(device=device, dtype=config.params_dtype)
        self.weight1 = nn.Parameter(torch.stack(w1).to(**kw).contiguous())
        self.weight2 = nn.Parameter(torch.stack(w2).to(**kw).contiguous())
        for p, dim in ((self.weight1, 1), (self.weight2, 2)):
            p.expert_parallel = True
            p.tensor_model_parallel, p.partition_dim = True, dim
            p.partition_stride = stride if dim == 1 else 1

    def _activation(self, y: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            gate, up = y.chunk(2, dim=-1)
            return F.silu(gate) * up
        return F.gelu(y, approximate="tanh" if self.openai_gelu else "none")

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        w1, w2 = self.weight1, self.weight2
        if x.shape[0] == 0:  # stay in the graph: backward must reach the collectives before
            return x.new_zeros(0, w2.shape[1]) + 0.0 * (x.sum() + w1.sum() + w2.sum())
        if self.grouped_gemm:
            return self._grouped(x, counts, w1, w2)
        outs = []
        for i, rows in enumerate(x.split(counts)):  # [n_i, h]
            outs.append(self._activation(rows @ w1[i].t()) @ w2[i].t())
        return torch.cat(outs)

    def _grouped(self, x, counts, w1, w2) -> torch.Tensor:
        n = len(counts)
        if x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm"):
            offs = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
            y = torch._grouped_mm(x, w1.transpose(1, 2), offs=offs)
            return torch._grouped_mm(self._activation(y), w2.transpose(1, 2), offs=offs)
        counts_t = torch.tensor(counts, device=x.device)
        expert = torch.repeat_interleave(torch.arange(n, device=x.device), counts_t)  # [N]
        starts = torch.cumsum(counts_t, 0) - counts_t
        slot = torch.arange(x.shape[0], device=x.device) - starts[expert]
        padded = x.new_zeros(n, max(counts), x.shape[1]).index_put((expert, slot), x)
        y = self._activation(torch.bmm(padded, w1.transpose(1, 2)))  # [E_local, max_n, f1/etp]
        out = torch.bmm(y, w2.transpose(1, 2))  # [E_local, max_n, h]
        return out[expert, slot]

"""The experts of one EP rank: ``E_local`` MLPs, each sharded over the expert-TP group.

Weights are stacked per local expert: ``weight1`` # [E_local, f1/etp, h] (``f1`` = 2f under SwiGLU,
the full ``[gate; up]`` rows of each expert split with stride 2 like ``MLP``'s ``linear_fc1``) and
``weight2`` # [E_local, h, f/etp]. Local expert ``i`` of EP rank ``r`` is global expert
``r * E_local + i``; each expert's full weight is initialised from its global index's key, so the
numbers do not depend on EP or ETP. Without bias (as Mixtral and Qwen2-MoE).

Input: tokens grouped by local expert, # [N, h] with ``counts[i]`` rows for expert i. Output
# [N, h], a partial sum over the ETP group (each rank holds a slice of the ffn dim).

Compute and saved activations follow the tokens routed: expert ``i`` multiplies its own
``counts[i]`` rows, never rows padded to the busiest expert's count, so a skewed routing costs what
it routes. Two paths compute the same numbers:
- a loop of one matmul per expert over its contiguous slice of ``x`` (every device and dtype);
- with ``grouped_gemm``, ``torch._grouped_mm`` (one kernel per linear over all experts) where
  it is measured faster: ``grouped_mm_serves`` says where; elsewhere the loop.
Both give the same numbers (bit-identical on an H100, torch 2.11, in bf16, fp16 and fp32).
No path pads every expert to the busiest one's count for one ``torch.bmm`` per linear: that
grows with E_local x max(count). Measured on an H100 (8 experts, top-2, SwiGLU, fwd+bwd, 70% of
the tokens to one expert): at h 2048 it takes 1.9x the loop's time and 2.8x its memory; it wins
only where kernel launches dominate (h 256, 2k tokens: 0.8x ``_grouped_mm``'s time in fp16/fp32),
at 2.9x the memory.
Both save, per routed row, its input [h], the fc1 output [f1/etp] and the activation's output
[f/etp] (SwiGLU: also silu(gate) [f/etp]).

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

# torch._grouped_mm on CUDA sm90+, measured faster than the loop in each dtype from the torch
# version given (H100, torch 2.11: tools/bench/bench_moe.py); its bf16 kernel came in 2.8
GROUPED_MM_SINCE = {torch.bfloat16: "2.8", torch.float16: "2.11", torch.float32: "2.11"}
GROUPED_MM_MIN_CAPABILITY = (9, 0)  # below sm90 torch falls back to a loop with a host sync


def grouped_mm_serves(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` computes ``x @ w1[i].t()`` and ``y @ w2[i].t()`` here (one
    kernel per linear over all experts): a contiguous CUDA tensor on an sm90+ device, in a dtype
    this torch serves (``GROUPED_MM_SINCE``), weights of the same dtype, and every row the kernel
    reads (x and the output # [N, h], the fc1 output # [N, f1/etp], the activation
    # [N, f/etp]) a multiple of 16 bytes (its alignment). Decided from the inputs alone, before
    any math. On CPU torch's ``_grouped_mm`` loops over the experts too, measured no faster than
    ours (and slower at h 1024), so the loop serves there."""
    since = GROUPED_MM_SINCE.get(x.dtype)
    if since is None or not x.is_cuda or not hasattr(torch, "_grouped_mm"):
        return False
    if torch.__version__ < since or not x.is_contiguous():
        return False
    if w1.dtype != x.dtype or w2.dtype != x.dtype:
        return False
    if torch.cuda.get_device_capability(x.device) < GROUPED_MM_MIN_CAPABILITY:
        return False
    row_elements = (x.shape[1], w1.shape[1], w2.shape[2])  # h, f1/etp, f/etp
    return all(n * x.element_size() % 16 == 0 for n in row_elements)


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
        """x # [N, h], rows grouped by local expert (``counts[i]`` rows for expert i, a host
        list) -> # [N, h], the ETP partial sum."""
        w1, w2 = self.weight1, self.weight2
        if x.shape[0] == 0:  # stay in the graph: backward must reach the collectives before
            return x.new_zeros(0, w2.shape[1]) + 0.0 * (x.sum() + w1.sum() + w2.sum())
        if self.grouped_gemm and grouped_mm_serves(x, w1, w2):
            offs = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
            y = torch._grouped_mm(x, w1.transpose(1, 2), offs=offs)  # [N, f1/etp]
            return torch._grouped_mm(self._activation(y), w2.transpose(1, 2), offs=offs)
        outs = []
        # unbind, not w1[i]: its backward stacks the experts' weight grads into one [E_local, ..]
        # tensor, where indexing's adds E_local zero-filled copies of the whole weight
        for rows, a, b in zip(x.split(counts), w1.unbind(0), w2.unbind(0)):  # rows: [n_i, h]
            outs.append(self._activation(rows @ a.t()) @ b.t())
        return torch.cat(outs)

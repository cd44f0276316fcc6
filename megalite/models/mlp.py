"""The transformer's MLP: ``linear_fc2(act(linear_fc1(x)))``, the ffn dim split over TP.

GELU (exact, HF ``"gelu"``; or tanh-approximate with ``openai_gelu``, HF ``"gelu_new"``), or SwiGLU
(HF Llama: ``down(silu(gate(x)) * up(x))``). Under SwiGLU ``linear_fc1`` is one ColumnParallelLinear
of ``2 * ffn`` outputs whose full weight is ``[gate; up]``, sharded with ``stride=2`` so each rank
holds its rows of both blocks and ``chunk(2)`` of its output gives its gate and up. The linears come
from the tensor-parallel mode (``tensor_parallel_mode(ps)``: 1d's column/row pair, or a grid's).
``squared_relu``: ``relu(x)^2`` in place of GELU (as Megatron's).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megalite.core.parallel_state import ParallelState
from megalite.core.tensor_parallel.modes import tensor_parallel_mode
from megalite.models.common import weight_init
from megalite.models.config import GPTConfig


class MLP(nn.Module):
    """Input # [s, b, h] ([s/tp, b, h] under sequence parallel); output the same shape."""

    def __init__(
        self,
        config: GPTConfig,
        ps: ParallelState,
        *,
        layer_number: int,
        device: torch.device | None = None,
    ):
        super().__init__()
        prefix = f"decoder.layers.{layer_number}.mlp"
        self.swiglu, self.openai_gelu = config.swiglu, config.openai_gelu
        self.squared_relu = config.squared_relu
        mode = tensor_parallel_mode(ps)
        common = dict(
            bias=config.add_bias_linear,
            sequence_parallel=config.sequence_parallel,
            params_dtype=config.params_dtype,
            device=device,
        )
        ffn = config.ffn_hidden_size
        self.linear_fc1 = mode.column_linear(
            config.hidden_size,
            2 * ffn if self.swiglu else ffn,
            stride=2 if self.swiglu else 1,
            init_method=weight_init(config, f"{prefix}.linear_fc1.weight"),
            **common,
        )
        self.linear_fc2 = mode.row_linear(
            ffn,
            config.hidden_size,
            init_method=weight_init(config, f"{prefix}.linear_fc2.weight", scaled=True),
            **common,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = self.linear_fc1(x)  # [s, b, ffn/tp] (SwiGLU: [s, b, 2 * ffn/tp])
        if self.swiglu:
            gate, up = y.chunk(2, dim=-1)
            y = F.silu(gate) * up
        elif self.squared_relu:
            y = torch.pow(F.relu(y), 2)
        else:
            y = F.gelu(y, approximate="tanh" if self.openai_gelu else "none")
        out, _ = self.linear_fc2(y)  # [s(/tp), b, h]
        return out

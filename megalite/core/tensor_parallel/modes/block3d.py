"""How attention and the MLP split under 3D TP: residual layout in, inner layout between the two
linears, residual layout out (``layers3d.py``).

Attention: the QKV output's inner-layout hidden block ``input_rank`` of q holds whole query groups
(the fused QKV weight is laid out per query group, ``[q_1..q_k, k, v]`` for each group, as in 1D),
so a rank attends for ``num_query_groups / q`` groups of its ``b/q^2`` sequences, whole sequences:
the core attention and RoPE are local, exactly as on one device. MLP: the ffn dim is split in q
by ``linear_fc1``'s inner layout; GELU is elementwise, and SwiGLU's ``[gate; up]`` is a ``stride=2``
``Linear3D``, so ``chunk(2, -1)`` of a rank's output gives its gate and up.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from megalite.core.tensor_parallel.init import InitMethod, default_init
from megalite.core.tensor_parallel.modes.grid3d import Groups3D
from megalite.core.tensor_parallel.modes.layers3d import Linear3D, check_divides

# (query, key) # [s, b, heads, d] -> the same, rotated; None: no RoPE
Rotary = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class SelfAttention3D(nn.Module):
    """Causal self-attention. Input and output # [s, b/q^2, h/q], residual layout; the batch must
    be whole sequences (it is: 3D splits ``b``, never ``s``)."""

    def __init__(
        self,
        hidden_size: int,
        num_attention_heads: int,
        groups: Groups3D,
        *,
        num_query_groups: int | None = None,
        bias: bool = True,
        init_qkv: InitMethod = default_init,
        init_proj: InitMethod = default_init,
        rotary: Rotary | None = None,
    ):
        super().__init__()
        q = groups.q
        kv = num_query_groups or num_attention_heads
        check_divides(num_attention_heads, kv, what="num_attention_heads over num_query_groups")
        check_divides(kv, q, what="num_query_groups")
        check_divides(hidden_size, num_attention_heads, what="hidden_size over heads")
        self.head_dim = hidden_size // num_attention_heads
        self.per_group = num_attention_heads // kv  # query heads per group
        self.rotary = rotary
        qkv_size = (num_attention_heads + 2 * kv) * self.head_dim
        self.linear_qkv = Linear3D(
            hidden_size, qkv_size, groups, input_layout="residual", bias=bias, init_method=init_qkv
        )
        self.linear_proj = Linear3D(
            num_attention_heads * self.head_dim,
            hidden_size,
            groups,
            input_layout="inner",
            bias=bias,
            init_method=init_proj,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.linear_qkv(x)  # [s, b/q^2, (kv/q) * (per_group + 2) * d], inner layout
        s, b = qkv.shape[:2]
        qkv = qkv.view(s, b, -1, self.per_group + 2, self.head_dim)
        query = qkv[:, :, :, : self.per_group].reshape(s, b, -1, self.head_dim)
        key, value = qkv[:, :, :, self.per_group], qkv[:, :, :, self.per_group + 1]
        if self.rotary is not None:
            query, key = self.rotary(query, key)
        key = key.repeat_interleave(self.per_group, dim=2)  # GQA: each group's key for its heads
        value = value.repeat_interleave(self.per_group, dim=2)
        # [s, b, heads, d] -> [b, heads, s, d] and back
        out = F.scaled_dot_product_attention(
            *(t.permute(1, 2, 0, 3) for t in (query, key, value)), is_causal=True
        )
        out = out.permute(2, 0, 1, 3).reshape(s, b, -1)  # [s, b/q^2, heads/q * d]
        return self.linear_proj(out)


class MLP3D(nn.Module):
    """``fc2(act(fc1(x)))``, act GELU (exact) or SwiGLU. Input and output # [s, b/q^2, h/q],
    residual layout; between the linears # [s, b/q^2, ffn/q], inner layout."""

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        groups: Groups3D,
        *,
        swiglu: bool = False,
        bias: bool = True,
        init_fc1: InitMethod = default_init,
        init_fc2: InitMethod = default_init,
    ):
        super().__init__()
        self.swiglu = swiglu
        self.linear_fc1 = Linear3D(
            hidden_size,
            2 * ffn_hidden_size if swiglu else ffn_hidden_size,
            groups,
            input_layout="residual",
            bias=bias,
            stride=2 if swiglu else 1,
            init_method=init_fc1,
        )
        self.linear_fc2 = Linear3D(
            ffn_hidden_size,
            hidden_size,
            groups,
            input_layout="inner",
            bias=bias,
            init_method=init_fc2,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear_fc1(x)
        if self.swiglu:
            gate, up = y.chunk(2, dim=-1)
            y = F.silu(gate) * up
        else:
            y = F.gelu(y)
        return self.linear_fc2(y)

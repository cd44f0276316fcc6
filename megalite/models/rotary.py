"""Rotary position embeddings (RoPE) in HuggingFace Llama's convention.

``inv_freq[i] = 1 / base^(2i / d)`` for ``i < d/2``; the angle of position p is ``p * inv_freq``,
repeated for the two halves of the head dim (non-interleaved: element j pairs with j + d/2), and
``rope(x) = x * cos + rotate_half(x) * sin`` with ``rotate_half([x1, x2]) = [-x2, x1]``.
The angles are computed in fp32 and cast to the activations' dtype, as HF does.

Under context parallelism a rank holds two chunks of the sequence, so its positions are those
chunks' positions (``local_position_ids``), the same rule that slices its tokens: the angles of a
token do not depend on the split.
"""

from __future__ import annotations

import torch

from megalite.core.context_parallel.chunking import cp_token_indices


def rotary_cos_sin(
    position_ids: torch.Tensor, *, head_dim: int, base: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for ``position_ids`` ``[b, s]`` (or ``[1, s]``): each ``[s, b, 1, head_dim]``,
    ready to broadcast over ``[s, b, heads, head_dim]`` query and key tensors."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=position_ids.device).float()
    inv_freq = 1.0 / (base ** (exponent / head_dim))  # [d/2]
    angles = position_ids.t().float().unsqueeze(-1) * inv_freq  # [s, b, d/2]
    emb = torch.cat((angles, angles), dim=-1).unsqueeze(2)  # [s, b, 1, d]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: # [s, b, heads, d]; cos, sin: # [s, b or 1, 1, d]."""
    return x * cos + rotate_half(x) * sin


def local_position_ids(
    local_length: int, *, cp_size: int = 1, cp_rank: int = 0, device: torch.device | None = None
) -> torch.Tensor:
    """Default positions # [1, s/cp] of the ``local_length`` tokens a cp rank holds: 0..s-1 on
    one rank, the rank's two chunks' positions under context parallelism."""
    return cp_token_indices(local_length * cp_size, cp_size, cp_rank, device).unsqueeze(0)

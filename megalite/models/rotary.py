"""Rotary position embeddings (RoPE) in HuggingFace Llama's convention.

``inv_freq[i] = 1 / base^(2i / d)`` for ``i < d/2``; the angle of position p is ``p * inv_freq``,
repeated for the two halves of the head dim (non-interleaved: element j pairs with j + d/2), and
``rope(x) = x * cos + rotate_half(x) * sin`` with ``rotate_half([x1, x2]) = [-x2, x1]``.
The angles are computed in fp32 and cast to the activations' dtype, as HF does.

Megatron's options: ``rotary_percent`` < 1 rotates only the first
``2 * len(inv_freq)`` channels of each head, with ``inv_freq[i] = 1 / base^(2i / r)``,
``r = int(d * rotary_percent)``, and passes the rest through; ``interleaved`` pairs channel 2i with
2i + 1 (``rotate_half`` then maps ``[x0, x1, x2, x3, ..]`` to ``[-x1, x0, -x3, x2, ..]``);
``rope_scaling_factor`` applies Llama 3.1's frequency scaling (HF ``rope_type="llama3"`` with
low / high frequency factors 1 and 4 over an original context of 8192, the values Megatron fixes).

Under context parallelism a rank holds two chunks of the sequence, so its positions are those
chunks' positions (``local_position_ids``), the same rule that slices its tokens: the angles of a
token do not depend on the split.
"""

from __future__ import annotations

import math

import torch

from megalite.core.context_parallel.chunking import cp_token_indices

LLAMA3_LOW_FREQ_FACTOR, LLAMA3_HIGH_FREQ_FACTOR, LLAMA3_ORIGINAL_CONTEXT = 1.0, 4.0, 8192


def llama3_scaled_inv_freq(inv_freq: torch.Tensor, factor: float) -> torch.Tensor:
    """Llama 3.1's scaling: wavelengths above ``8192 / 1`` are divided by ``factor``, those below
    ``8192 / 4`` kept, those between interpolated smoothly."""
    context = LLAMA3_ORIGINAL_CONTEXT
    low, high = LLAMA3_LOW_FREQ_FACTOR, LLAMA3_HIGH_FREQ_FACTOR
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= context / high) & (wavelen <= context / low)
    return torch.where(medium, smoothed, scaled)


def rotary_inv_freq(
    head_dim: int,
    *,
    base: float,
    rotary_percent: float = 1.0,
    rope_scaling_factor: float | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """The fp32 inverse frequencies # [ceil(r/2)], ``r = int(head_dim * rotary_percent)``."""
    dim = int(head_dim * rotary_percent) if rotary_percent < 1.0 else head_dim
    exponent = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float()
    inv_freq = 1.0 / (base ** (exponent / dim))  # [r/2]
    if rope_scaling_factor is not None:
        inv_freq = llama3_scaled_inv_freq(inv_freq, rope_scaling_factor)
    return inv_freq


def rotary_cos_sin(
    position_ids: torch.Tensor,
    *,
    head_dim: int,
    base: float,
    dtype: torch.dtype,
    rotary_percent: float = 1.0,
    interleaved: bool = False,
    rope_scaling_factor: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for ``position_ids`` ``[b, s]`` (or ``[1, s]``): each ``[s, b, 1, r]`` (r the
    rotary channels: ``head_dim`` by default), ready to broadcast over ``[s, b, heads, head_dim]``
    query and key tensors (``apply_rotary`` passes channels past r through)."""
    inv_freq = rotary_inv_freq(
        head_dim,
        base=base,
        rotary_percent=rotary_percent,
        rope_scaling_factor=rope_scaling_factor,
        device=position_ids.device,
    )
    angles = position_ids.t().float().unsqueeze(-1) * inv_freq  # [s, b, r/2]
    if interleaved:  # [a0, a0, a1, a1, ...]
        emb = angles.repeat_interleave(2, dim=-1).unsqueeze(2)
    else:
        emb = torch.cat((angles, angles), dim=-1).unsqueeze(2)  # [s, b, 1, r]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    if interleaved:  # [x0, x1, x2, x3, ..] -> [-x1, x0, -x3, x2, ..]
        return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False
) -> torch.Tensor:
    """x: # [s, b, heads, d]; cos, sin: # [s, b or 1, 1, r] with r <= d: the first r channels
    rotate, the rest pass through (``rotary_percent`` < 1)."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return x * cos + rotate_half(x, interleaved) * sin
    rot, rest = x[..., :r], x[..., r:]
    return torch.cat((rot * cos + rotate_half(rot, interleaved) * sin, rest), dim=-1)


def local_position_ids(
    local_length: int, *, cp_size: int = 1, cp_rank: int = 0, device: torch.device | None = None
) -> torch.Tensor:
    """Default positions # [1, s/cp] of the ``local_length`` tokens a cp rank holds: 0..s-1 on
    one rank, the rank's two chunks' positions under context parallelism."""
    return cp_token_indices(local_length * cp_size, cp_size, cp_rank, device).unsqueeze(0)

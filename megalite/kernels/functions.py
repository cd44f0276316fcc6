"""torch.autograd.Functions around the fused kernels; megalite.core.fusions picks when.

Each saves only what its fused backward reads: softmax saves y (x's dtype); the norms save x,
weight and the fp32 per-row statistics (mean, rstd), never the normalised activations.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from megalite.kernels.layer_norm import norm_backward, norm_forward
from megalite.kernels.softmax import softmax_backward, softmax_forward


class FusedScaleMaskSoftmax(torch.autograd.Function):
    """y = softmax(scale * x + mask) over the last dim of # [b, heads, sq, sk]; grad for x only."""

    @staticmethod
    def forward(ctx, x, mask, scale, causal):
        y = softmax_forward(x, mask, scale, causal)
        ctx.save_for_backward(y)
        ctx.scale = scale
        ctx.causal = causal
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        return softmax_backward(y, dy, ctx.scale, ctx.causal), None, None, None


class FusedLayerNorm(torch.autograd.Function):
    """LayerNorm over the last dim: y = (x - mean) * rstd * weight + bias, y in x's dtype."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        y, mean, rstd = norm_forward(x, weight, bias, eps, rms=False)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        has_bias = ctx.bias_dtype is not None
        dx, dweight, dbias = norm_backward(dy, x, weight, mean, rstd, has_bias=has_bias, rms=False)
        dbias = dbias.to(ctx.bias_dtype) if has_bias else None
        return dx, dweight.to(weight.dtype), dbias, None


class FusedRMSNorm(torch.autograd.Function):
    """RMSNorm as HF Llama: weight * (x * rstd).to(x.dtype); y in promote(weight, x) dtype."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        y, mean, rstd = norm_forward(x, weight, None, eps, rms=True)
        ctx.save_for_backward(x, weight, mean, rstd)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        dx, dweight, _ = norm_backward(dy, x, weight, mean, rstd, has_bias=False, rms=True)
        return dx, dweight.to(weight.dtype), None


def fused_scale_mask_softmax(
    x: torch.Tensor, mask: torch.Tensor | None, scale: float, causal: bool
) -> torch.Tensor:
    """x: # [b, heads, sq, sk] -> y of the same shape and dtype (see megalite.core.fusions)."""
    return FusedScaleMaskSoftmax.apply(x, mask, scale, causal)


def fused_layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """x: # [..., n]; weight, bias: # [n] -> y in x's shape and dtype."""
    return FusedLayerNorm.apply(x, weight, bias, eps)


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: # [..., n]; weight: # [n] -> y in x's shape, dtype promote(weight, x)."""
    return FusedRMSNorm.apply(x, weight, eps)

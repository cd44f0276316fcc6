"""The one place that chooses between a fused Triton kernel and its PyTorch reference.

Every function here has the same signature whichever implementation serves it. ``use_fused=False``
forces the reference (the run turns fused kernels off, or the masked-softmax or persistent-LayerNorm
fusion alone). The fused path is taken when ``use_fused``, x's dtype is fp16, bf16 or fp32, triton
(>= 3.0) imports, and x is on CUDA, or ``TRITON_INTERPRET=1`` is set, which runs the same kernels on
CPU tensors through triton's interpreter (that is how the tests exercise them; triton must then have
been imported with the variable set, see tests/kernels/interpreter.py, else the reference serves and
a warning says why). triton is imported when a kernel first runs, never when megalite is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megalite.kernels import functions, runtime


def _use_triton(x: torch.Tensor, use_fused: bool) -> bool:
    return (
        use_fused
        and x.dtype in runtime.KERNEL_DTYPES
        and runtime.kernel_device_ok(x)
        and runtime.kernels_ready()
    )


def fused_kernels_on_cpu() -> bool:
    """Whether the fused kernels serve CPU tensors in this process: only under triton's
    interpreter (``TRITON_INTERPRET=1``) with triton importable. On a GPU they serve whenever
    the caller asks for them."""
    return runtime.interpreting() and runtime.kernels_ready()


def kernels_serve(device: str) -> bool:
    """Whether the fused kernels serve a model that asks for them (``use_fused``) on ``device``
    ("cuda" or "cpu"), for a plan made before the run: on a GPU always (a GPU install has triton:
    the plan is for the cluster, not this machine); on a CPU only in this process under the
    interpreter (``fused_kernels_on_cpu``). Whether the model asks is its own setting
    (``use_fused_kernels``); the per-call conditions of ``_use_triton`` (dtype, mask) hold for
    every tensor megalite's layers pass."""
    return device != "cpu" or fused_kernels_on_cpu()


def _reference_layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    *,
    use_fused: bool = True,
) -> torch.Tensor:
    """LayerNorm over the last dim; statistics in fp32, output in x's dtype.

    x: # [..., h]; weight, bias: # [h].
    """
    if _use_triton(x, use_fused):
        return functions.fused_layer_norm(x, weight, bias, eps)
    return _reference_layer_norm(x, weight, bias, eps)


def _reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, use_fused: bool = True
) -> torch.Tensor:
    """RMSNorm as HF Llama computes it: normalise in fp32, cast back, then scale by weight.

    x: # [..., h]; weight: # [h]; output dtype is promote(weight, x) as in HF.
    """
    if _use_triton(x, use_fused) and weight.dtype in runtime.KERNEL_DTYPES:
        return functions.fused_rms_norm(x, weight, eps)
    return _reference_rms_norm(x, weight, eps)


def _reference_scale_mask_softmax(
    x: torch.Tensor, *, scale: float, causal: bool, mask: torch.Tensor | None
) -> torch.Tensor:
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
    The fused kernel serves 4-dim scores with a bool (or no) mask; anything else the reference.
    """
    if (
        _use_triton(x, use_fused)
        and x.dim() == 4
        and (mask is None or (mask.dtype == torch.bool and mask.dim() <= 4))
    ):
        return functions.fused_scale_mask_softmax(x, mask, scale, causal)
    return _reference_scale_mask_softmax(x, scale=scale, causal=causal, mask=mask)

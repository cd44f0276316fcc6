"""Float64 references, written plainly and independently of megalite, and the tolerance check.

Tolerances are stated per dtype in units of the unit roundoff u (half an ulp at 1.0):
fp32 u = 2^-24, bf16 u = 2^-8 (8 significant bits), fp16 u = 2^-11 (11 significant bits).
"""

from __future__ import annotations

import pytest
import torch

UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.bfloat16, id="bf16"),
    pytest.param(torch.float16, id="fp16"),
]


def assert_within(
    actual: torch.Tensor,
    ref: torch.Tensor,
    *,
    rel: float,
    atol: float | torch.Tensor,
    what: str,
) -> None:
    """|actual - ref| <= rel * |ref| + atol, elementwise; ref is float64, atol a number or a tensor
    broadcastable to ref.

    ``rel`` covers the final rounding of each element to its dtype; ``atol`` covers errors that
    scale with the size of the terms summed or cancelled rather than with the result. Half the
    subnormal spacing of actual's dtype is always allowed: no result in that dtype can be closer.
    """
    assert actual.shape == ref.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(ref.shape)}"
    a = actual.detach().double()
    assert torch.isfinite(a).all(), f"{what}: non-finite values in the kernel's result"
    err = (a - ref).abs()
    floor = torch.finfo(actual.dtype).smallest_normal * torch.finfo(actual.dtype).eps / 2
    bound = rel * ref.abs() + atol + floor
    bound = bound.expand(ref.shape)
    bad = err > bound
    if bad.any():
        i = int((err - bound).argmax())
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {err.numel()} elements out of tolerance; worst at flat "
            f"index {i}: got {a.flatten()[i].item():.8g}, want {ref.flatten()[i].item():.8g}, "
            f"error {err.flatten()[i].item():.3g} > bound {bound.flatten()[i].item():.3g} "
            f"(max error {err.max().item():.3g}, max |ref| {ref.abs().max().item():.3g})"
        )


def softmax64(
    x: torch.Tensor, scale: float, causal: bool, mask: torch.Tensor | None
) -> torch.Tensor:
    """softmax(scale * x) over the last dim in float64 with masked keys removed; rows with no key
    left are zeros. Differentiable (autograd gives the float64 reference gradient)."""
    s = x.double() * scale
    sq, sk = x.shape[-2], x.shape[-1]
    hidden = torch.zeros(sq, sk, dtype=torch.bool)
    if causal:
        i = torch.arange(sq)[:, None]
        j = torch.arange(sk)[None, :]
        hidden = j > i + (sk - sq)
    if mask is not None:
        hidden = hidden | mask
    hidden = hidden.expand(s.shape)
    empty_row = hidden.all(-1, keepdim=True)
    s = s.masked_fill(hidden | empty_row, float("-inf")).masked_fill(empty_row, 0.0)
    return torch.softmax(s, -1) * (~empty_row)


def layer_norm64(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    x = x.double()
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    y = (x - mean) / torch.sqrt(var + eps) * weight.double()
    return y if bias is None else y + bias.double()


def rms_norm64(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight.double()


def grads64(fn, inputs: list[torch.Tensor], dy: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """float64 gradients of sum(fn(*inputs) * dy) with respect to every input."""
    leaves = [t.detach().double().requires_grad_(True) for t in inputs]
    y = fn(*leaves)
    return torch.autograd.grad(y, leaves, dy.double())

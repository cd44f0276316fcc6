"""Fused scale-mask-softmax over the last dim of [b, heads, sq, sk] attention scores.

Forward: ``y = softmax(scale * x + mask)``, one program per row ``(b, head, query)``; statistics in
fp32 whatever the input dtype, y in x's dtype. Masking is either causal (key j hidden when
j > i + (sk - sq), no mask tensor read) or a boolean mask (True = masked out) broadcastable to x,
read through its strides so a ``[b, 1, sq, sk]`` mask is never expanded in memory. A row with
every key masked gives zeros, never NaN.

Backward: ``dx = scale * y * (dy - sum(dy * y))`` from the saved y, also fused and fp32 inside.

Rows up to ``MAX_BLOCK`` keys sit in registers (x read once); longer rows loop over column blocks
with an online max/sum (x read twice). The Triton source is _softmax_kernels.py, built (and triton
imported) only when a kernel first runs.
"""

from __future__ import annotations

import torch

from megalite.kernels._common import Kernels
from megalite.kernels._softmax_kernels import build_softmax_kernels
from megalite.kernels.runtime import (
    block_for,
    num_warps_for,
    require_mode_match,
    rows_per_program,
)

# Longest row kept whole in registers; longer rows loop over blocks of this many keys.
MAX_BLOCK = 16384


def _kernels() -> Kernels:
    """The jitted kernels (built on the first call: that imports triton), after checking that
    triton's mode (compiled / interpreted) is the one TRITON_INTERPRET asks for."""
    require_mode_match()
    return build_softmax_kernels()


def _check_scores(x: torch.Tensor, name: str) -> None:
    if x.dim() != 4:
        raise ValueError(
            f"fused softmax: {name} must be [b, heads, sq, sk] (4 dims), got shape "
            f"{tuple(x.shape)}; reshape it or pass use_fused=False"
        )


def softmax_forward(
    x: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    causal: bool,
    *,
    max_block: int = MAX_BLOCK,
) -> torch.Tensor:
    """y = softmax(scale * x + mask) over the last dim. x: # [b, heads, sq, sk]; y: x's shape/dtype.

    ``mask``: bool, True = masked out, broadcastable to x (e.g. # [b, 1, sq, sk]); ``causal`` hides
    key j > i + (sk - sq). ``max_block`` is the longest row held in registers (tests lower it to
    exercise the looped path).
    """
    _check_scores(x, "x")
    x = x.contiguous()
    b, heads, sq, sk = x.shape
    y = torch.empty_like(x)
    if mask is not None:
        if mask.dtype != torch.bool:
            raise TypeError(
                f"fused softmax: mask must be torch.bool (True = masked), got {mask.dtype}"
            )
        try:
            mask = mask.expand(b, heads, sq, sk)  # a view: broadcast dims get stride 0
        except RuntimeError as err:
            raise ValueError(
                f"fused softmax: mask of shape {tuple(mask.shape)} does not broadcast to scores "
                f"{tuple(x.shape)}"
            ) from err
        mask_strides = mask.stride()
        mask_arg = mask
    else:
        mask_strides = (0, 0, 0, 0)
        mask_arg = x  # never read (HAS_MASK=False), any pointer will do
    if x.numel() == 0:
        return y
    block, num_blocks = block_for(sk, max_block)
    m, rows = b * heads * sq, rows_per_program(block, num_blocks)
    _kernels().fwd[(-(-m // rows),)](
        x,
        mask_arg,
        y,
        float(scale),
        sq,
        sk,
        heads,
        *mask_strides,
        m,
        CAUSAL=bool(causal),
        HAS_MASK=mask is not None,
        BLOCK=block,
        NUM_BLOCKS=num_blocks,
        ROWS=rows,
        num_warps=num_warps_for(block),
    )
    return y


def softmax_backward(
    y: torch.Tensor,
    dy: torch.Tensor,
    scale: float,
    causal: bool,
    *,
    max_block: int = MAX_BLOCK,
) -> torch.Tensor:
    """dx = scale * y * (dy - sum(dy * y)) over the last dim; y, dy, dx: # [b, heads, sq, sk]."""
    _check_scores(y, "y")
    y = y.contiguous()
    dy = dy.contiguous()
    b, heads, sq, sk = y.shape
    dx = torch.empty_like(y)
    if y.numel() == 0:
        return dx
    block, num_blocks = block_for(sk, max_block)
    m, rows = b * heads * sq, rows_per_program(block, num_blocks)
    _kernels().bwd[(-(-m // rows),)](
        y,
        dy,
        dx,
        float(scale),
        sq,
        sk,
        m,
        CAUSAL=bool(causal),
        BLOCK=block,
        NUM_BLOCKS=num_blocks,
        ROWS=rows,
        num_warps=num_warps_for(block),
    )
    return dx

"""Fused LayerNorm and RMSNorm over the last dim, forward and backward.

x is viewed as rows # [m, n] (m = every leading dim folded). Forward: one program per row reads x
once, computes the row mean and rstd in fp32, saves them (# [m] fp32 each) and writes y.
Backward: G programs each take rows pid, pid + G, ...; they write dx row by row and accumulate
dweight / dbias for their rows in fp32 into one partial row each (# [G, n]); a small final sum over
G finishes them (two-stage reduction, no atomics, deterministic).

RMSNorm follows HF Llama: ``weight * (x * rstd).to(x.dtype)``, so the normalised value is rounded
to x's dtype before the weight multiplies it, and the output dtype is the promotion of weight's and
x's. LayerNorm writes y in x's dtype.

Rows up to ``MAX_BLOCK`` elements are held in registers (next power of two of n); longer rows loop
over column blocks (x read three times forward, partials updated in memory backward). The Triton
source is _norm_kernels.py, built (and triton imported) only when a kernel first runs.
"""

from __future__ import annotations

import torch

from megalite.kernels._common import Kernels
from megalite.kernels._norm_kernels import build_norm_kernels
from megalite.kernels.runtime import (
    block_for,
    num_warps_for,
    reduction_programs,
    require_mode_match,
    rows_per_program,
)

# Longest row held whole in registers; hidden sizes above it loop over blocks of this size.
MAX_BLOCK = 16384


def _kernels() -> Kernels:
    """The jitted kernels (built on the first call: that imports triton), after checking that
    triton's mode (compiled / interpreted) is the one TRITON_INTERPRET asks for."""
    require_mode_match()
    return build_norm_kernels()


def _rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(
            f"fused norm: weight shape {tuple(weight.shape)} must be ({n},), the last dim of x "
            f"{tuple(x.shape)}"
        )
    return x.contiguous().view(-1, n)  # [m, n]


def norm_forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    *,
    rms: bool,
    max_block: int = MAX_BLOCK,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (y, mean, rstd): y has x's shape; mean and rstd are # [m] fp32 (mean is empty for
    RMSNorm; it is the first-pass fp32 mean, whose small residual the backward re-derives from x).
    y's dtype: x's for LayerNorm, promote(weight, x) for RMSNorm (HF Llama)."""
    x2 = _rows(x, weight)
    m, n = x2.shape
    out_dtype = torch.promote_types(weight.dtype, x.dtype) if rms else x.dtype
    y = torch.empty((m, n), dtype=out_dtype, device=x.device)
    mean = torch.empty(0 if rms else m, dtype=torch.float32, device=x.device)
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    if m > 0 and n > 0:
        block, num_blocks = block_for(n, max_block)
        rows = rows_per_program(block, num_blocks)
        _kernels().fwd[(-(-m // rows),)](
            x2,
            weight.contiguous(),
            bias.contiguous() if bias is not None else weight,
            y,
            mean if not rms else rstd,  # RMS never writes MEAN
            rstd,
            m,
            n,
            float(eps),
            IS_RMS=rms,
            HAS_BIAS=bias is not None,
            BLOCK=block,
            NUM_BLOCKS=num_blocks,
            ROWS=rows,
            num_warps=num_warps_for(block),
        )
    return y.view(x.shape), mean, rstd


def norm_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    *,
    has_bias: bool,
    rms: bool,
    max_block: int = MAX_BLOCK,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Returns (dx, dweight, dbias or None): dx in x's dtype and shape; dweight and dbias # [n] in
    fp32, each reduced over all rows in two stages (partials # [G, n], then a sum over G)."""
    x2 = _rows(x, weight)
    m, n = x2.shape
    dy2 = dy.contiguous().view(m, n)
    dx = torch.empty_like(x2)
    programs = reduction_programs(m, x.device)
    block, num_blocks = block_for(n, max_block)
    # one block: each program writes its whole partial row; looped: programs add into them
    alloc = torch.empty if num_blocks == 1 and m > 0 else torch.zeros
    dw_part = alloc((programs, n), dtype=torch.float32, device=x.device)
    db_part = alloc((programs, n) if has_bias else (1, 1), dtype=torch.float32, device=x.device)
    if m > 0 and n > 0:
        _kernels().bwd[(programs,)](
            x2,
            weight.contiguous(),
            dy2,
            dx,
            mean if not rms else rstd,
            rstd,
            dw_part,
            db_part,
            m,
            n,
            IS_RMS=rms,
            HAS_BIAS=has_bias,
            BLOCK=block,
            NUM_BLOCKS=num_blocks,
            ROWS=rows_per_program(block, num_blocks),
            num_warps=num_warps_for(block),
        )
    dweight = dw_part.sum(0)
    dbias = db_part.sum(0) if has_bias else None
    return dx.view(x.shape), dweight, dbias

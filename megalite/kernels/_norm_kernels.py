"""Triton source of fused LayerNorm / RMSNorm (layer_norm.py has the contract and launchers).

The kernels are plain functions here, jitted by ``build_norm_kernels`` on a kernel's first
use (layer_norm.py's launchers; ``_common`` says how): nothing imports triton at import time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megalite.kernels._common import Kernels, jit_kernels

if TYPE_CHECKING:  # supplied by kernel_namespace
    import triton.language as tl

    from megalite.kernels._common import round_to


def norm_fwd(
    X,
    W,
    B,
    Y,
    SHIFT,
    RSTD,
    m,
    n,
    eps,
    IS_RMS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
    NUM_BLOCKS: tl.constexpr,
    ROWS: tl.constexpr,
):
    # LayerNorm centres in two steps: shift = fp32 mean (off by its summation error), then
    # x - shift (exact for x near the mean) loses its small residual mean ``corr``. The variance
    # is taken about the corrected mean, so a row at offset 1e4 with spread 1 keeps full fp32
    # accuracy; shift is saved and the backward recomputes corr the same way.
    cols = tl.arange(0, BLOCK)
    if NUM_BLOCKS == 1:
        # a tile of ROWS whole rows: short rows share a program (ROWS is 1 for long ones)
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        row_live = rows < m
        live = row_live[:, None] & (cols[None, :] < n)
        offs = rows[:, None] * n + cols[None, :]
        x = tl.load(X + offs, mask=live, other=0.0).to(tl.float32)
        if IS_RMS:
            xc = x
        else:
            shift = tl.sum(x, 1) / n
            xc = tl.where(live, x - shift[:, None], 0.0)
            xc = tl.where(live, xc - (tl.sum(xc, 1) / n)[:, None], 0.0)
            tl.store(SHIFT + rows, shift, mask=row_live)
        rstd = tl.rsqrt(tl.sum(xc * xc, 1) / n + eps)
        tl.store(RSTD + rows, rstd, mask=row_live)
        xhat = xc * rstd[:, None]
        if IS_RMS:
            xhat = round_to(xhat, X.dtype.element_ty).to(tl.float32)  # HF: cast back, then weight
        y = xhat * tl.load(W + cols, mask=cols < n, other=0.0).to(tl.float32)[None, :]
        if HAS_BIAS:
            y += tl.load(B + cols, mask=cols < n, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + offs, round_to(y, Y.dtype.element_ty), mask=live)
    else:
        row = tl.program_id(0).to(tl.int64)
        x_row = X + row * n
        y_row = Y + row * n
        shift = 0.0
        if not IS_RMS:
            acc = tl.zeros([BLOCK], tl.float32)
            for start in range(0, n, BLOCK):
                live = start + cols < n
                acc += tl.load(x_row + start + cols, mask=live, other=0.0).to(tl.float32)
            shift = tl.sum(acc, 0) / n
        acc_s = tl.zeros([BLOCK], tl.float32)
        acc_q = tl.zeros([BLOCK], tl.float32)
        for start in range(0, n, BLOCK):
            live = start + cols < n
            x = tl.load(x_row + start + cols, mask=live, other=0.0).to(tl.float32)
            xc = tl.where(live, x - shift, 0.0)
            acc_s += xc
            acc_q += xc * xc
        if IS_RMS:
            corr = 0.0
            var = tl.sum(acc_q, 0) / n
        else:
            corr = tl.sum(acc_s, 0) / n
            var = tl.maximum(tl.sum(acc_q, 0) / n - corr * corr, 0.0)
        rstd = tl.rsqrt(var + eps)
        for start in range(0, n, BLOCK):
            live = start + cols < n
            x = tl.load(x_row + start + cols, mask=live, other=0.0).to(tl.float32)
            xhat = (x - shift - corr) * rstd
            if IS_RMS:
                xhat = round_to(xhat, X.dtype.element_ty).to(tl.float32)
            y = xhat * tl.load(W + start + cols, mask=live, other=0.0).to(tl.float32)
            if HAS_BIAS:
                y += tl.load(B + start + cols, mask=live, other=0.0).to(tl.float32)
            tl.store(y_row + start + cols, round_to(y, Y.dtype.element_ty), mask=live)
        if not IS_RMS:
            tl.store(SHIFT + row, shift)
        tl.store(RSTD + row, rstd)


def norm_bwd(
    X,
    W,
    DY,
    DX,
    SHIFT,
    RSTD,
    DW_PART,
    DB_PART,
    m,
    n,
    IS_RMS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
    NUM_BLOCKS: tl.constexpr,
    ROWS: tl.constexpr,
):
    # dx = rstd * (w*dy - xhat * mean(xhat * w*dy) - mean(w*dy))   (RMS: no last term)
    # dweight = sum over rows of dy * xhat, dbias = sum of dy: this program's rows only
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    dw_part = DW_PART + tl.cast(pid, tl.int64) * n
    db_part = DB_PART + tl.cast(pid, tl.int64) * n
    if NUM_BLOCKS == 1:
        # tiles of ROWS whole rows, program pid taking every programs-th tile
        col_live = cols < n
        w = tl.load(W + cols, mask=col_live, other=0.0).to(tl.float32)[None, :]
        acc_dw = tl.zeros([BLOCK], tl.float32)
        acc_db = tl.zeros([BLOCK], tl.float32)
        for first in range(pid * ROWS, m, programs * ROWS):
            rows = tl.cast(first, tl.int64) + tl.arange(0, ROWS)
            row_live = rows < m
            live = row_live[:, None] & col_live[None, :]
            offs = rows[:, None] * n + cols[None, :]
            x = tl.load(X + offs, mask=live, other=0.0).to(tl.float32)
            dy = tl.load(DY + offs, mask=live, other=0.0).to(tl.float32)
            rstd = tl.load(RSTD + rows, mask=row_live, other=0.0)[:, None]
            if IS_RMS:
                xhat = x * rstd
            else:
                shift = tl.load(SHIFT + rows, mask=row_live, other=0.0)[:, None]
                xc = tl.where(live, x - shift, 0.0)
                xhat = tl.where(live, (xc - (tl.sum(xc, 1) / n)[:, None]) * rstd, 0.0)
            wdy = w * dy
            c1 = (tl.sum(xhat * wdy, 1) / n)[:, None]
            if IS_RMS:
                dx = (wdy - xhat * c1) * rstd
                acc_dw += tl.sum(dy * round_to(xhat, X.dtype.element_ty).to(tl.float32), 0)
            else:
                c2 = (tl.sum(wdy, 1) / n)[:, None]
                dx = (wdy - (xhat * c1 + c2)) * rstd
                acc_dw += tl.sum(dy * xhat, 0)
            if HAS_BIAS:
                acc_db += tl.sum(dy, 0)
            tl.store(DX + offs, round_to(dx, DX.dtype.element_ty), mask=live)
        tl.store(dw_part + cols, acc_dw, mask=col_live)
        if HAS_BIAS:
            tl.store(db_part + cols, acc_db, mask=col_live)
    else:
        # partial rows start zeroed; this program alone owns row pid of them
        for row in range(pid, m, programs):
            base = tl.cast(row, tl.int64) * n
            rstd = tl.load(RSTD + row)
            shift = 0.0
            if not IS_RMS:
                shift = tl.load(SHIFT + row)
            acc_xw = tl.zeros([BLOCK], tl.float32)
            acc_w = tl.zeros([BLOCK], tl.float32)
            acc_x = tl.zeros([BLOCK], tl.float32)
            for start in range(0, n, BLOCK):
                live = start + cols < n
                x = tl.load(X + base + start + cols, mask=live, other=0.0).to(tl.float32)
                dy = tl.load(DY + base + start + cols, mask=live, other=0.0).to(tl.float32)
                w = tl.load(W + start + cols, mask=live, other=0.0).to(tl.float32)
                xc = tl.where(live, x - shift, 0.0)
                acc_xw += xc * w * dy
                acc_w += w * dy
                acc_x += xc
            corr = 0.0
            if not IS_RMS:
                corr = tl.sum(acc_x, 0) / n
            c2 = tl.sum(acc_w, 0) / n
            c1 = rstd * (tl.sum(acc_xw, 0) / n - corr * c2)  # mean(xhat * w*dy)
            for start in range(0, n, BLOCK):
                live = start + cols < n
                x = tl.load(X + base + start + cols, mask=live, other=0.0).to(tl.float32)
                dy = tl.load(DY + base + start + cols, mask=live, other=0.0).to(tl.float32)
                w = tl.load(W + start + cols, mask=live, other=0.0).to(tl.float32)
                xhat = (x - shift - corr) * rstd
                if IS_RMS:
                    dx = (w * dy - xhat * c1) * rstd
                    xhat = round_to(xhat, X.dtype.element_ty).to(tl.float32)
                else:
                    dx = (w * dy - (xhat * c1 + c2)) * rstd
                tl.store(DX + base + start + cols, round_to(dx, DX.dtype.element_ty), mask=live)
                part = tl.load(dw_part + start + cols, mask=live, other=0.0)
                tl.store(dw_part + start + cols, part + dy * xhat, mask=live)
                if HAS_BIAS:
                    part = tl.load(db_part + start + cols, mask=live, other=0.0)
                    tl.store(db_part + start + cols, part + dy, mask=live)


def build_norm_kernels() -> Kernels:
    """The jitted kernels (built on the first call, in the mode TRITON_INTERPRET gives then)."""
    return jit_kernels(norm_fwd, norm_bwd)

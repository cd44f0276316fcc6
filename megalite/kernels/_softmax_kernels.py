"""Triton source of the fused scale-mask-softmax (see softmax.py for the contract and launchers).

The kernels are plain functions here, jitted by ``build_softmax_kernels`` on a kernel's first
use (softmax.py's launchers; ``_common`` says how): nothing imports triton at import time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megalite.kernels._common import Kernels, jit_kernels

if TYPE_CHECKING:  # supplied by kernel_namespace
    import triton.language as tl

    from megalite.kernels._common import round_to


def softmax_fwd(
    X,
    MASK,
    Y,
    scale,
    sq,
    sk,
    heads,
    stride_mb,
    stride_mh,
    stride_mq,
    stride_mk,
    m,
    CAUSAL: tl.constexpr,
    HAS_MASK: tl.constexpr,
    BLOCK: tl.constexpr,
    NUM_BLOCKS: tl.constexpr,
    ROWS: tl.constexpr,
):
    # rows run over b * heads * sq; a program takes a tile of ROWS of them (1 when rows loop)
    cols = tl.arange(0, BLOCK)
    if NUM_BLOCKS == 1:
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        q = rows % sq
        bh = rows // sq
        m_rows = MASK + (bh // heads) * stride_mb + (bh % heads) * stride_mh + q * stride_mq
        last_keys = q + (sk - sq)  # causal: keys 0..last_key are visible
        in_row = (rows < m)[:, None] & (cols < sk)[None, :]
        keep = in_row
        if CAUSAL:
            keep = keep & (cols[None, :] <= last_keys[:, None])
        if HAS_MASK:
            hidden = tl.load(m_rows[:, None] + cols[None, :] * stride_mk, mask=in_row, other=1)
            keep = keep & (hidden == 0)
        offs = rows[:, None] * sk + cols[None, :]
        s = tl.load(X + offs, mask=keep, other=0.0).to(tl.float32) * scale
        s = tl.where(keep, s, float("-inf"))
        row_max = tl.max(s, 1)
        row_max = tl.where(row_max == float("-inf"), 0.0, row_max)  # fully masked row
        e = tl.exp(s - row_max[:, None])  # exp(-inf) = 0 at masked keys
        denom = tl.sum(e, 1)
        inv = tl.where(denom > 0.0, 1.0 / tl.where(denom > 0.0, denom, 1.0), 0.0)
        tl.store(Y + offs, round_to(e * inv[:, None], Y.dtype.element_ty), mask=in_row)
    else:
        row = tl.program_id(0).to(tl.int64)
        q = row % sq
        bh = row // sq
        x_row = X + row * sk
        y_row = Y + row * sk
        m_row = MASK + (bh // heads) * stride_mb + (bh % heads) * stride_mh + q * stride_mq
        last_key = q + (sk - sq)
        # pass 1: per-lane running max and rescaled sum (online softmax), merged at the end
        lane_max = tl.full([BLOCK], float("-inf"), tl.float32)
        lane_sum = tl.zeros([BLOCK], tl.float32)
        for start in range(0, sk, BLOCK):
            c = start + cols
            keep = c < sk
            if CAUSAL:
                keep = keep & (c <= last_key)
            if HAS_MASK:
                hidden = tl.load(m_row + c * stride_mk, mask=c < sk, other=1)
                keep = keep & (hidden == 0)
            s = tl.load(x_row + c, mask=keep, other=0.0).to(tl.float32) * scale
            s = tl.where(keep, s, float("-inf"))
            new_max = tl.maximum(lane_max, s)
            safe = tl.where(new_max == float("-inf"), 0.0, new_max)
            lane_sum = lane_sum * tl.exp(lane_max - safe) + tl.exp(s - safe)
            lane_max = new_max
        row_max = tl.max(lane_max, 0)
        row_max = tl.where(row_max == float("-inf"), 0.0, row_max)
        denom = tl.sum(lane_sum * tl.exp(lane_max - row_max), 0)
        inv = tl.where(denom > 0.0, 1.0 / tl.where(denom > 0.0, denom, 1.0), 0.0)
        # pass 2: normalise and write
        for start in range(0, sk, BLOCK):
            c = start + cols
            keep = c < sk
            if CAUSAL:
                keep = keep & (c <= last_key)
            if HAS_MASK:
                hidden = tl.load(m_row + c * stride_mk, mask=c < sk, other=1)
                keep = keep & (hidden == 0)
            s = tl.load(x_row + c, mask=keep, other=0.0).to(tl.float32) * scale
            y = tl.where(keep, tl.exp(s - row_max) * inv, 0.0)
            tl.store(y_row + c, round_to(y, Y.dtype.element_ty), mask=c < sk)


def softmax_bwd(
    Y,
    DY,
    DX,
    scale,
    sq,
    sk,
    m,
    CAUSAL: tl.constexpr,
    BLOCK: tl.constexpr,
    NUM_BLOCKS: tl.constexpr,
    ROWS: tl.constexpr,
):
    # y = 0 at masked keys, so dx = 0 there; causal rows skip reading past the diagonal
    cols = tl.arange(0, BLOCK)
    if NUM_BLOCKS == 1:  # a tile of ROWS rows
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        n_read = tl.where(rows < m, sk, 0)
        if CAUSAL:
            n_read = tl.minimum(tl.maximum(rows % sq + (sk - sq) + 1, 0), n_read)
        live = cols[None, :] < n_read[:, None]
        offs = rows[:, None] * sk + cols[None, :]
        y = tl.load(Y + offs, mask=live, other=0.0).to(tl.float32)
        dy = tl.load(DY + offs, mask=live, other=0.0).to(tl.float32)
        dot = tl.sum(y * dy, 1)
        dx = scale * y * (dy - dot[:, None])
        in_row = (rows < m)[:, None] & (cols < sk)[None, :]
        tl.store(DX + offs, round_to(dx, DX.dtype.element_ty), mask=in_row)
    else:
        row = tl.program_id(0).to(tl.int64)
        n_read = sk
        if CAUSAL:
            n_read = tl.minimum(tl.maximum(row % sq + (sk - sq) + 1, 0), sk)
        y_row = Y + row * sk
        dy_row = DY + row * sk
        dx_row = DX + row * sk
        acc = tl.zeros([BLOCK], tl.float32)
        for start in range(0, sk, BLOCK):
            live = (start + cols) < n_read
            y = tl.load(y_row + start + cols, mask=live, other=0.0).to(tl.float32)
            dy = tl.load(dy_row + start + cols, mask=live, other=0.0).to(tl.float32)
            acc += y * dy
        dot = tl.sum(acc, 0)
        for start in range(0, sk, BLOCK):
            live = (start + cols) < n_read
            y = tl.load(y_row + start + cols, mask=live, other=0.0).to(tl.float32)
            dy = tl.load(dy_row + start + cols, mask=live, other=0.0).to(tl.float32)
            dx = scale * y * (dy - dot)
            tl.store(
                dx_row + start + cols, round_to(dx, DX.dtype.element_ty), mask=(start + cols) < sk
            )


def build_softmax_kernels() -> Kernels:
    """The jitted kernels (built on the first call, in the mode TRITON_INTERPRET gives then)."""
    return jit_kernels(softmax_fwd, softmax_bwd)

"""The fused LayerNorm / RMSNorm kernels, run on CPU through triton's interpreter (conftest.py),
against float64 references: y, dx, dweight, dbias for hidden sizes 1, 17, 4095, 5120 and 16384,
fp32 / bf16 / fp16, inputs of large magnitude or large offset, and the looped path for long rows.

Tolerances (u = tolerance_unit: 2^-8 bf16, 2^-11 fp16, 2^-18 = 64 fp32 roundoffs for fp32, which
covers fp32 tree sums over <= 2^14 terms and the GPU's approximate rsqrt):
- y: |err| <= 3u |y| + u max|y|. Inside, everything is fp32; y is rounded once to its dtype
  (RMSNorm rounds twice, HF-style: x * rstd to x's dtype, then times weight); the u max|y| term
  covers LayerNorm outputs where xhat * w and b cancel.
- dx = rstd (w dy - xhat mean(xhat w dy) - mean(w dy)) is rounded once from fp32, but its terms
  can cancel (hidden size 1 RMSNorm: dx ~ eps / x^2 of each term), so the absolute part scales with
  the terms: |err| <= 2u |dx| + u rstd (|w dy| + |xhat| mean|xhat w dy| + mean|w dy|).
- dweight = sum over rows of dy * xhat, dbias = sum of dy: each term carries an error of about u
  relative (RMSNorm's xhat is rounded as in HF), so |err| <= 2u |d| + 2u sum|term| elementwise.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the fused kernels cannot run")

from megalite.kernels.layer_norm import MAX_BLOCK, norm_backward, norm_forward  # noqa: E402
from megalite.kernels.runtime import block_for, reduction_programs, rows_per_program  # noqa: E402
from tests.kernels.reference import (  # noqa: E402
    DTYPES,
    assert_within,
    grads64,
    layer_norm64,
    rms_norm64,
)

EPS = 1e-5
KINDS = ["layernorm", "layernorm-nobias", "rmsnorm"]


def tolerance_unit(dtype: torch.dtype) -> float:
    return {torch.float32: 2.0**-18, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[dtype]


def make_inputs(shape, dtype, kind, *, seed=0, x_scale=1.0, x_offset=0.0):
    gen = torch.Generator().manual_seed(seed)
    n = shape[-1]
    x = (x_offset + x_scale * torch.randn(shape, generator=gen, dtype=torch.float64)).to(dtype)
    weight = (1 + 0.5 * torch.randn(n, generator=gen)).to(dtype)
    bias = (0.5 * torch.randn(n, generator=gen)).to(dtype) if kind == "layernorm" else None
    return x, weight, bias


def check_norm(x, weight, bias, *, rms: bool, max_block: int = MAX_BLOCK) -> None:
    """Fused forward + backward on x, each result checked against float64 autograd."""
    u = tolerance_unit(x.dtype)
    gen = torch.Generator().manual_seed(11)
    dy = torch.randn(x.shape, generator=gen).to(x.dtype)

    y, mean, rstd = norm_forward(x, weight, bias, EPS, rms=rms, max_block=max_block)
    dx, dw, db = norm_backward(
        dy, x, weight, mean, rstd, has_bias=bias is not None, rms=rms, max_block=max_block
    )
    dw = dw.to(weight.dtype)  # as FusedLayerNorm / FusedRMSNorm return them
    assert y.dtype == x.dtype and dx.dtype == x.dtype and y.shape == x.shape

    if rms:
        inputs, fn = [x, weight], lambda a, w: rms_norm64(a, w, EPS)
    elif bias is None:
        inputs, fn = [x, weight], lambda a, w: layer_norm64(a, w, None, EPS)
    else:
        inputs, fn = [x, weight, bias], lambda a, w, b: layer_norm64(a, w, b, EPS)
    y64 = fn(*inputs)
    g64 = grads64(fn, inputs, dy)
    tag = f"{'rms' if rms else 'ln'} n={x.shape[-1]} {x.dtype}"
    assert_within(y, y64, rel=3 * u, atol=u * y64.abs().max(), what=f"y {tag}")

    rows = x.double().reshape(-1, x.shape[-1])  # [m, n]
    dy_rows = dy.double().reshape(-1, x.shape[-1])
    centred = rows if rms else rows - rows.mean(-1, keepdim=True)
    rstd64 = torch.rsqrt((centred**2).mean(-1, keepdim=True) + EPS)
    xhat = centred * rstd64
    wdy = (weight.double() * dy_rows).abs()
    terms = rstd64 * (wdy + xhat.abs() * (xhat.abs() * wdy).mean(-1, keepdim=True))
    terms = terms + (0 if rms else rstd64 * wdy.mean(-1, keepdim=True))
    assert_within(dx, g64[0], rel=2 * u, atol=u * terms.view(x.shape), what=f"dx {tag}")

    dw_terms = (dy_rows * xhat).abs().sum(0)
    assert_within(dw, g64[1], rel=2 * u, atol=2 * u * dw_terms, what=f"dweight {tag}")
    if bias is not None:
        db = db.to(bias.dtype)
        db_terms = dy_rows.abs().sum(0)
        assert_within(db, g64[2], rel=2 * u, atol=2 * u * db_terms, what=f"dbias {tag}")
    else:
        assert db is None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [1, 17, 4095, 5120])
@pytest.mark.parametrize("kind", KINDS)
def test_matches_float64(dtype: torch.dtype, hidden: int, kind: str) -> None:
    # 6 rows on 4 programs: two programs reduce two rows each into their partial dweight/dbias
    assert reduction_programs(6, torch.device("cpu")) < 6
    x, weight, bias = make_inputs((2, 3, hidden), dtype, kind)
    check_norm(x, weight, bias, rms=kind == "rmsnorm")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows,hidden", [(549, 17), (9, 1000)], ids=["549x17", "9x1000"])
def test_row_tiles_across_programs(kind: str, rows: int, hidden: int) -> None:
    # short rows share a program: 17 -> tiles of 64 rows, 9 tiles (the last of 37 rows), each of
    # the backward's 4 programs looping over two or three; 1000 -> tiles of 2 rows, the last half
    # empty
    assert rows_per_program(*block_for(hidden, MAX_BLOCK)) == {17: 64, 1000: 2}[hidden]
    x, weight, bias = make_inputs((rows, hidden), torch.float32, kind, seed=5)
    check_norm(x, weight, bias, rms=kind == "rmsnorm")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_large_magnitude_inputs(dtype: torch.dtype, kind: str) -> None:
    x, weight, bias = make_inputs((5, 300), dtype, kind, seed=1, x_scale=1e4)
    check_norm(x, weight, bias, rms=kind == "rmsnorm")


@pytest.mark.parametrize("max_block", [MAX_BLOCK, 64], ids=["one-block", "looped"])
def test_large_offset_keeps_fp32_accuracy(max_block: int) -> None:
    # rows at 1e4 with spread 1: a plain fp32 mean is off by ~1e-3 here; the kernel re-centres
    x, weight, bias = make_inputs((5, 1000), torch.float32, "layernorm", seed=2, x_offset=1e4)
    check_norm(x, weight, bias, rms=False, max_block=max_block)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("hidden,max_block", [(17, 16), (5120, 1024)], ids=["n17", "n5120"])
def test_looped_path_for_long_rows(dtype: torch.dtype, kind: str, hidden: int, max_block: int):
    x, weight, bias = make_inputs((2, 3, hidden), dtype, kind, seed=3)
    check_norm(x, weight, bias, rms=kind == "rmsnorm", max_block=max_block)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("hidden", [16384, 20000], ids=["n16384-one-block", "n20000-looped"])
def test_wide_rows(kind: str, hidden: int) -> None:
    x, weight, bias = make_inputs((3, hidden), torch.bfloat16, kind, seed=4)
    check_norm(x, weight, bias, rms=kind == "rmsnorm")


def test_weight_shape_is_checked() -> None:
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match=r"weight shape \(7,\) must be \(8,\)"):
        norm_forward(x, torch.ones(7), None, EPS, rms=False)

"""The fused scale-mask-softmax kernels, run on CPU through triton's interpreter (conftest.py),
against a float64 reference: outputs and input grads, causal / boolean-mask / both / none, sk not a
power of two, fully masked rows, inputs of large magnitude, and the looped path for long rows.

Tolerances (u = unit roundoff of the dtype; tolerance_unit below):
- y: |err| <= 2u |y| + u max|y|. For bf16/fp16 the only error of size u is the final rounding of y
  to its dtype (everything inside is fp32, ~2^-24); the second u covers fp16 subnormals (values
  below 6e-5 keep an absolute, not relative, precision). For fp32 the unit is 64 fp32 roundoffs
  (2^-18): the row sum over up to 2^13 terms is a tree of depth <= 13 and the GPU's exp is ~2 ulp.
- dx = scale * y * (dy - sum(dy * y)): the saved y is rounded (u relative, or half a subnormal
  step s/2 for tiny fp16 values) and the dot is a sum of |y||dy| terms, so elementwise
  |err| <= 2u |dx| + scale (4u |y| + s) (|dy| + max|dy|).
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the fused kernels cannot run")

from megalite.kernels.softmax import softmax_backward, softmax_forward  # noqa: E402
from tests.kernels.reference import DTYPES, assert_within, grads64, softmax64  # noqa: E402


def tolerance_unit(dtype: torch.dtype) -> float:
    return {torch.float32: 2.0**-18, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[dtype]


def check_softmax(
    x: torch.Tensor,
    *,
    scale: float,
    causal: bool,
    mask: torch.Tensor | None,
    max_block: int | None = None,
) -> torch.Tensor:
    """Run the fused forward and backward on x, check y and dx against float64; return y."""
    kwargs = {} if max_block is None else {"max_block": max_block}
    u = tolerance_unit(x.dtype)
    gen = torch.Generator().manual_seed(1)
    dy = torch.randn(x.shape, generator=gen).to(x.dtype)

    y = softmax_forward(x, mask, scale, causal, **kwargs)
    dx = softmax_backward(y, dy, scale, causal, **kwargs)
    assert y.dtype == x.dtype and dx.dtype == x.dtype

    y64 = softmax64(x, scale, causal, mask)
    (dx64,) = grads64(lambda t: softmax64(t, scale, causal, mask), [x], dy)
    assert_within(y, y64, rel=2 * u, atol=u * y64.abs().max(), what=f"y {x.dtype}")
    dy64 = dy.double()
    dot_scale = dy64.abs() + dy64.abs().amax(-1, keepdim=True)
    half_step = torch.finfo(x.dtype).smallest_normal * torch.finfo(x.dtype).eps / 2
    atol = abs(scale) * (4 * u * y64.abs() + 2 * half_step) * dot_scale
    assert_within(dx, dx64, rel=2 * u, atol=atol, what=f"dx {x.dtype}")
    return y


def random_mask(shape: tuple[int, ...], *, seed: int, empty_rows: bool) -> torch.Tensor:
    """# [b, 1, sq, sk] bool, ~40% masked; with empty_rows, query 1 of every batch is all masked."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(shape, generator=gen) < 0.4
    if empty_rows:
        mask[:, :, 1, :] = True
    return mask


@pytest.mark.parametrize("dtype", DTYPES)
# (3, 5, 7, 37): 105 rows in tiles of 32 (the last of 9), tiles crossing batch and head borders
@pytest.mark.parametrize(
    "shape",
    [(2, 2, 5, 37), (1, 2, 3, 1000), (3, 5, 7, 37)],
    ids=["sk37", "sk1000", "sk37-row-tiles"],
)
@pytest.mark.parametrize("variant", ["causal", "mask", "causal+mask", "none"])
def test_matches_float64(dtype: torch.dtype, shape: tuple[int, ...], variant: str) -> None:
    b, heads, sq, sk = shape
    gen = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(shape, generator=gen)).to(dtype)
    mask = None
    if "mask" in variant:
        mask = random_mask((b, 1, sq, sk), seed=2, empty_rows=True)
    check_softmax(x, scale=1 / math.sqrt(80), causal="causal" in variant, mask=mask)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fully_masked_rows_give_zeros(dtype: torch.dtype) -> None:
    # causal with sq > sk: query i sees keys j <= i - 3, so queries 0..2 see nothing
    x = torch.randn(2, 2, 7, 4).to(dtype)
    y = check_softmax(x, scale=0.5, causal=True, mask=None)
    assert torch.equal(y[:, :, :3], torch.zeros_like(y[:, :, :3]))
    # an explicit all-True mask row, and a mask that hides everything
    mask = torch.zeros(2, 1, 7, 4, dtype=torch.bool)
    mask[1, 0, 4] = True
    y = check_softmax(x, scale=0.5, causal=False, mask=mask)
    assert torch.equal(y[1, :, 4], torch.zeros_like(y[1, :, 4]))
    y = check_softmax(x, scale=0.5, causal=False, mask=torch.ones(1, 1, 1, 4, dtype=torch.bool))
    assert torch.equal(y, torch.zeros_like(y))


@pytest.mark.parametrize("dtype", DTYPES)
def test_large_magnitude_inputs(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    # values of size 1e4 (fp32 stats: no overflow in exp, the row max is subtracted first)
    x = (1e4 * torch.randn(2, 2, 3, 45, generator=gen)).clamp(-6e4, 6e4).to(dtype)
    check_softmax(x, scale=1.0, causal=True, mask=None)
    # a large common offset with a small spread: only the differences matter
    x = (1e4 + 8 * torch.randn(2, 2, 3, 45, generator=gen)).to(dtype)
    check_softmax(
        x, scale=0.5, causal=False, mask=random_mask((2, 1, 3, 45), seed=4, empty_rows=False)
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "mask"])
def test_looped_path_for_long_rows(dtype: torch.dtype, causal: bool) -> None:
    # rows longer than max_block loop over column blocks with an online max / sum
    gen = torch.Generator().manual_seed(5)
    x = (3 * torch.randn(1, 2, 4, 70, generator=gen)).to(dtype)
    mask = None if causal else random_mask((1, 1, 4, 70), seed=6, empty_rows=True)
    check_softmax(x, scale=0.3, causal=causal, mask=mask, max_block=16)


def test_mask_broadcast_shapes() -> None:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2, 3, 4, 9, generator=gen)
    full = torch.rand(2, 3, 4, 9, generator=gen) < 0.3
    for mask in (
        full,
        full[:, :1],
        full[:1, :1],
        full[0, 0],
    ):  # [b,h,..], [b,1,..], [1,1,..], 2-dim
        check_softmax(x, scale=0.7, causal=False, mask=mask)


def test_bad_inputs_are_refused() -> None:
    x = torch.randn(2, 3, 4, 9)
    with pytest.raises(TypeError, match="torch.bool"):
        softmax_forward(x, torch.zeros(2, 1, 4, 9), 1.0, False)
    with pytest.raises(ValueError, match="does not broadcast"):
        softmax_forward(x, torch.zeros(2, 1, 4, 8, dtype=torch.bool), 1.0, False)
    with pytest.raises(ValueError, match=r"\[b, heads, sq, sk\]"):
        softmax_forward(x[0], None, 1.0, True)

"""Triton helpers shared by the kernel sources. Importing this module imports triton.

``round_to(v, DTYPE)`` casts fp32 v to DTYPE rounded to nearest even. Compiled kernels use triton's
cast (cvt.rn on NVIDIA). triton's interpreter truncates fp32 -> bf16 instead (checked on 3.9: about
half the values land one bf16 ulp toward zero), so under it bf16 is rounded in software: add 0x7FFF
plus the lowest kept bit, keep the high 16 bits (NaN stays NaN). Interpreted results then carry the
bits the GPU writes, and the tests can hold bf16 to half an ulp.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

# Fixed when this module is imported, i.e. before triton.jit decorates the kernels that use it.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
SOFT_BF16 = tl.constexpr(INTERPRETED)  # a compiled kernel reads only constexpr globals


def _round_to(v, DTYPE: tl.constexpr):
    if SOFT_BF16 and DTYPE == tl.bfloat16:
        bits = v.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = tl.where(v != v, 0x7FC00000, bits + 0x7FFF + ((bits >> 16) & 1))
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return v.to(DTYPE)


# Under the interpreter a @triton.jit helper re-patches triton.language on every call (several
# milliseconds, once per program instance: most of an interpreted kernel's time); a plain function
# called from an interpreted kernel runs as ordinary Python on the same patched language.
round_to = _round_to if INTERPRETED else triton.jit(_round_to)

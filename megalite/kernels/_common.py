"""What the Triton kernel sources share: the names they read, and how they become kernels.

The kernel sources (``_softmax_kernels``, ``_norm_kernels`` and ``round_to`` here) are plain
functions that read ``tl``, the jitted ``round_to`` and ``SOFT_BF16`` as globals their modules
do not bind: nothing imports triton at import time. ``kernel_namespace`` (built on a kernel's
first use: it imports triton) holds them; ``jit_kernels`` gives a family's source functions that
namespace as their globals (``bind``) and wraps them in ``triton.jit``, once per process.
Globals, not a closure: triton's jit reads a compiled kernel's names from its globals and
closure, but the interpreter re-executes the source in the function's globals only (checked on
3.9), so only globals serve both modes.

``round_to(v, DTYPE)`` casts fp32 v to DTYPE rounded to nearest even. Compiled kernels use triton's
cast (cvt.rn on NVIDIA). triton's interpreter truncates fp32 -> bf16 instead (checked on 3.9: about
half the values land one bf16 ulp toward zero), so under it bf16 is rounded in software: add 0x7FFF
plus the lowest kept bit, keep the high 16 bits (NaN stays NaN). Interpreted results then carry the
bits the GPU writes, and the tests can hold bf16 to half an ulp.
"""

from __future__ import annotations

import functools
import os
import types
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:  # supplied by kernel_namespace when a kernel is first built
    import triton.language as tl

    SOFT_BF16 = tl.constexpr(False)


def round_to(v, DTYPE: tl.constexpr):
    if SOFT_BF16 and DTYPE == tl.bfloat16:
        bits = v.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = tl.where(v != v, 0x7FC00000, bits + 0x7FFF + ((bits >> 16) & 1))
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return v.to(DTYPE)


def bind(fn: types.FunctionType, namespace: dict) -> types.FunctionType:
    """A copy of the source function ``fn`` whose globals are ``namespace`` (same code, source
    lines and annotations, so triton reads it as it would ``fn``)."""
    bound = types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__)
    bound.__annotations__ = dict(fn.__annotations__)
    bound.__qualname__, bound.__module__, bound.__doc__ = fn.__qualname__, fn.__module__, fn.__doc__
    return bound


@functools.cache
def kernel_namespace() -> dict:
    """The globals of every kernel, for the mode TRITON_INTERPRET gives at the first call (before
    any kernel is built). Imports triton."""
    import triton
    import triton.language as tl

    interpreted = os.environ.get("TRITON_INTERPRET", "0") == "1"
    # a compiled kernel reads only constexpr globals
    namespace = {"__name__": __name__, "tl": tl, "SOFT_BF16": tl.constexpr(interpreted)}
    helper = bind(round_to, namespace)
    # Under the interpreter a @triton.jit helper re-patches triton.language on every call (several
    # milliseconds, once per program instance: most of an interpreted kernel's time); a plain
    # function called from an interpreted kernel runs as ordinary Python on the same patched
    # language.
    namespace["round_to"] = helper if interpreted else triton.jit(helper)
    return namespace


class Kernels(NamedTuple):
    """A family's jitted kernels: ``triton.JITFunction`` compiled, its interpreted twin under
    TRITON_INTERPRET=1."""

    fwd: object
    bwd: object


@functools.cache
def jit_kernels(fwd: types.FunctionType, bwd: types.FunctionType) -> Kernels:
    """The source functions bound to ``kernel_namespace`` and jitted, once per process."""
    import triton

    namespace = kernel_namespace()
    return Kernels(triton.jit(bind(fwd, namespace)), triton.jit(bind(bwd, namespace)))

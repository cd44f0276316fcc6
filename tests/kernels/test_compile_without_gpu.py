"""The fused kernels compile for a CUDA target on a machine without a GPU.

triton's code generator resolves a compiled kernel's names (``tl``, the jitted ``round_to``, the
constexpr ``SOFT_BF16``) differently from the interpreter the other tests here run, so a kernel
that runs interpreted may still fail to compile. A subprocess that imports triton compiled (no
TRITON_INTERPRET) builds every kernel through PTX for sm_90 (triton ships the compiler; no device
is needed) in fp32 and bf16, both code paths (one register block, a loop over blocks), and checks
that bf16 stores go through the hardware's round-to-nearest cast (the compiled ``round_to``).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="triton is not installed: the fused kernels cannot compile")

_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from megalite.kernels._norm_kernels import build_norm_kernels
from megalite.kernels._softmax_kernels import build_softmax_kernels

softmax, norm = build_softmax_kernels(), build_norm_kernels()
i32, f32 = "i32", "fp32"
for dt in ("fp32", "bf16"):
    p = "*" + dt
    cases = [
        (softmax.fwd, [p, "*i1", p, f32] + [i32] * 8, (True, True), "CAUSAL HAS_MASK".split()),
        (softmax.bwd, [p, p, p, f32, i32, i32, i32], (True,), ["CAUSAL"]),
        (norm.fwd, [p, p, p, p, "*fp32", "*fp32", i32, i32, f32], (True, False),
         ["IS_RMS", "HAS_BIAS"]),
        (norm.bwd, [p] * 4 + ["*fp32"] * 4 + [i32, i32], (False, True), ["IS_RMS", "HAS_BIAS"]),
    ]
    for fn, types, flags, flag_names in cases:
        for blocks in (1, 2):
            names = fn.arg_names
            consts = dict(zip(flag_names, flags), BLOCK=64, NUM_BLOCKS=blocks)
            if "ROWS" in names:  # a tile of 4 rows on the one-block path, else one row
                consts["ROWS"] = 4 if blocks == 1 else 1
            sig = dict(zip(names, types)) | {k: "constexpr" for k in consts}
            constexprs = {(names.index(k),): v for k, v in consts.items()}
            src = ASTSource(fn=fn, signature=sig, constexprs=constexprs)
            ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
            assert ("cvt.rn.bf16" in ptx) == (dt == "bf16"), (fn.__name__, dt)
print("compiled")
"""


def test_every_kernel_compiles_for_sm90() -> None:
    import triton.backends

    if "nvidia" not in triton.backends.backends:
        pytest.skip("this triton has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", _COMPILE], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0 and "compiled" in done.stdout, done.stdout + done.stderr[-4000:]

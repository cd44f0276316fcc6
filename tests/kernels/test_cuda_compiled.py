"""The fused kernels compiled for a CUDA GPU, checked with the interpreter tests' own checks.

``check_norm`` and ``check_softmax`` (test_layer_norm.py, test_softmax.py) run the kernels and
compare every result with float64 autograd, with tolerances derived there. Here the kernel entry
points they call are swapped for wrappers that move the inputs to the GPU and the results back,
so the same cases and bounds apply to the compiled kernels. Skipped unless CUDA is available and
triton runs compiled, which a normal pytest session never does (tests/conftest.py imports triton
interpreted); ``scripts/gpu_check.sh`` runs this file alone with ``pytest --noconftest``.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the fused kernels cannot run")

from megalite.kernels import runtime  # noqa: E402
from tests.kernels import test_layer_norm, test_softmax  # noqa: E402
from tests.kernels.test_softmax import random_mask  # noqa: E402


def _compiled_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    if runtime.interpreting():
        return "TRITON_INTERPRET=1: the kernels would be interpreted, not compiled"
    if not runtime.triton_available():
        return "triton is missing or too old"
    return runtime.mode_mismatch()


pytestmark = pytest.mark.skipif(
    _compiled_reason() is not None, reason=f"compiled kernels cannot run: {_compiled_reason()}"
)


def _on_gpu(fn):
    """fn with its tensor arguments moved to CUDA and its tensor results moved back to CPU."""

    def move(v, device):
        return v.to(device) if isinstance(v, torch.Tensor) else v

    def wrapped(*args, **kwargs):
        out = fn(
            *(move(a, "cuda") for a in args), **{k: move(v, "cuda") for k, v in kwargs.items()}
        )
        torch.cuda.synchronize()
        return tuple(move(o, "cpu") for o in out) if isinstance(out, tuple) else move(out, "cpu")

    return wrapped


@pytest.fixture(autouse=True)
def kernels_on_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    for module, names in (
        (test_layer_norm, ("norm_forward", "norm_backward")),
        (test_softmax, ("softmax_forward", "softmax_backward")),
    ):
        for name in names:
            monkeypatch.setattr(module, name, _on_gpu(getattr(module, name)))


DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [17, 2048, 5120, 8192])
@pytest.mark.parametrize("kind", test_layer_norm.KINDS)
def test_norms_compiled_match_float64(dtype: torch.dtype, hidden: int, kind: str) -> None:
    # 1000 rows: many programs on the GPU each reduce a share into their partial dweight rows
    x, w, b = test_layer_norm.make_inputs((1000, hidden), dtype, kind)
    test_layer_norm.check_norm(x, w, b, rms=kind == "rmsnorm")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("sk", [37, 1000, 4096])
@pytest.mark.parametrize("variant", ["causal", "mask", "causal+mask"])
def test_softmax_compiled_matches_float64(dtype: torch.dtype, sk: int, variant: str) -> None:
    shape = (2, 4, min(sk, 64), sk)
    gen = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(shape, generator=gen)).to(dtype)
    mask = None
    if "mask" in variant:
        mask = random_mask((shape[0], 1, shape[2], sk), seed=2, empty_rows=True)
    test_softmax.check_softmax(x, scale=1 / math.sqrt(128), causal="causal" in variant, mask=mask)

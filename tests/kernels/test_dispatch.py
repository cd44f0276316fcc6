"""megalite.core.fusions: when the fused kernels serve and when the PyTorch reference does, that
both give the same numbers through the public API (autograd included), and that importing megalite
never imports triton.

Fused vs reference tolerance: both compute in fp32 and round once (RMSNorm twice, in HF's order) to
the output dtype, so they agree to one rounding of each side: rel 2u + u max|ref| (u = 2^-8 bf16;
fp32 results agree to 1e-5 relative, the fp32 sum-order difference over rows of <= 64 elements).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the fused kernels cannot run")

from megalite.core import fusions  # noqa: E402
from megalite.kernels import runtime  # noqa: E402
from megalite.kernels.softmax import softmax_forward  # noqa: E402
from tests.kernels.reference import assert_within  # noqa: E402

TOL = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (2 * 2.0**-8, 2.0**-8)}


def run_all(dtype: torch.dtype, *, use_fused: bool, weight_dtype: torch.dtype | None = None):
    """Outputs and grads of the three fused ops on small fixed inputs, through fusions."""
    gen = torch.Generator().manual_seed(0)
    wdt = weight_dtype or dtype
    x = torch.randn(2, 3, 40, generator=gen).to(dtype).requires_grad_(True)
    w = (1 + 0.3 * torch.randn(40, generator=gen)).to(wdt).requires_grad_(True)
    b = (0.3 * torch.randn(40, generator=gen)).to(wdt).requires_grad_(True)
    s = torch.randn(2, 2, 5, 24, generator=gen).to(dtype).requires_grad_(True)
    mask = torch.rand(2, 1, 5, 24, generator=gen) < 0.3
    outs = {
        "layer_norm": fusions.layer_norm(x, w, b, 1e-5, use_fused=use_fused),
        "rms_norm": fusions.rms_norm(x, w, 1e-6, use_fused=use_fused),
        "softmax": fusions.scale_mask_softmax(
            s, scale=0.25, causal=True, mask=mask, use_fused=use_fused
        ),
    }
    results = {}
    for name, y in outs.items():
        dy = torch.randn(y.shape, generator=gen).to(y.dtype)
        inputs = (s,) if name == "softmax" else (x, w, b) if name == "layer_norm" else (x, w)
        results[name] = (y, torch.autograd.grad(y, inputs, dy))
    return results


def grad_fn_names(results) -> dict[str, str]:
    return {name: type(y.grad_fn).__name__ for name, (y, _) in results.items()}


def test_fused_path_serves_cpu_tensors_under_the_interpreter() -> None:
    names = grad_fn_names(run_all(torch.float32, use_fused=True))
    assert names == {
        "layer_norm": "FusedLayerNormBackward",
        "rms_norm": "FusedRMSNormBackward",
        "softmax": "FusedScaleMaskSoftmaxBackward",
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_and_reference_agree(dtype: torch.dtype) -> None:
    fused = run_all(dtype, use_fused=True)
    ref = run_all(dtype, use_fused=False)
    assert not any(n.startswith("Fused") for n in grad_fn_names(ref).values())
    rel, abs_unit = TOL[dtype]
    for name in fused:
        (y, grads), (y_ref, grads_ref) = fused[name], ref[name]
        assert y.dtype == y_ref.dtype, name
        pairs = [(y, y_ref)] + list(zip(grads, grads_ref))
        for i, (a, r) in enumerate(pairs):
            assert a.dtype == r.dtype, f"{name}[{i}]"
            r64 = r.double()
            assert_within(a, r64, rel=rel, atol=abs_unit * r64.abs().max(), what=f"{name}[{i}]")


def test_mixed_dtypes_follow_the_reference() -> None:
    # fp32 weights with bf16 activations: LayerNorm returns bf16, RMSNorm promotes to fp32 (HF)
    fused = run_all(torch.bfloat16, use_fused=True, weight_dtype=torch.float32)
    ref = run_all(torch.bfloat16, use_fused=False, weight_dtype=torch.float32)
    for name in ("layer_norm", "rms_norm"):
        assert fused[name][0].dtype == ref[name][0].dtype, name
        assert [g.dtype for g in fused[name][1]] == [g.dtype for g in ref[name][1]], name
        r64 = ref[name][0].double()
        assert_within(fused[name][0], r64, rel=2**-7, atol=2**-8 * r64.abs().max(), what=name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_rms_norm_rounds_in_hf_order(dtype: torch.dtype) -> None:
    # HF Llama rounds x * rstd to x's dtype before the weight multiplies it. Rounding once at the
    # end instead changes ~25% of the bf16/fp16 outputs, so bitwise agreement on >= 99% pins the
    # order (the rest may differ by one ulp where fp32 rsqrt implementations differ).
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(8, 500, generator=gen).to(dtype).requires_grad_(True)
    w = (1 + 0.5 * torch.randn(500, generator=gen)).to(dtype)
    y = fusions.rms_norm(x, w, 1e-5)
    assert type(y.grad_fn).__name__ == "FusedRMSNormBackward"
    y, y_ref = y.detach(), fusions.rms_norm(x, w, 1e-5, use_fused=False).detach()
    assert (y == y_ref).float().mean().item() >= 0.99
    torch.testing.assert_close(y, y_ref, rtol=2 * torch.finfo(dtype).eps, atol=0)


def test_reference_serves_when_fused_is_off_or_impossible(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(2, 8, requires_grad=True)
    w = torch.ones(8, requires_grad=True)

    def served_by(**kw) -> str:
        return type(fusions.layer_norm(x, w, None, 1e-5, **kw).grad_fn).__name__

    assert served_by() == "FusedLayerNormBackward"
    assert served_by(use_fused=False) != "FusedLayerNormBackward"  # --no-fused-kernels etc.
    x64 = torch.randn(2, 8, dtype=torch.float64, requires_grad=True)
    assert not type(fusions.rms_norm(x64, w.double(), 1e-5).grad_fn).__name__.startswith("Fused")
    scores3d = torch.randn(2, 4, 4, requires_grad=True)  # not [b, heads, sq, sk]
    y = fusions.scale_mask_softmax(scores3d, scale=1.0, causal=True)
    assert not type(y.grad_fn).__name__.startswith("Fused")
    with monkeypatch.context() as m:
        m.setattr(runtime, "triton_available", lambda: False)
        assert served_by() != "FusedLayerNormBackward"
    monkeypatch.delenv("TRITON_INTERPRET")  # CPU tensor and no interpreter: nothing can run it
    assert served_by() != "FusedLayerNormBackward"


def test_mode_mismatch_is_refused_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    # conftest imported triton interpreted; with the variable unset the kernels cannot run
    assert runtime.mode_mismatch() is None
    monkeypatch.delenv("TRITON_INTERPRET")
    assert "TRITON_INTERPRET" in runtime.mode_mismatch()
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        softmax_forward(torch.randn(1, 1, 2, 2), None, 1.0, True)


# Imports every megalite module, first with triton unimportable (a None entry in sys.modules makes
# ``import triton`` raise ImportError), then checks none of them imported triton when it could.
_IMPORT_EVERY_MODULE = """
import importlib, pkgutil, sys
if sys.argv[1] == "blocked":
    sys.modules["triton"] = None
import megalite
failed = []
for info in pkgutil.walk_packages(megalite.__path__, "megalite."):
    try:
        importlib.import_module(info.name)
    except Exception as err:
        failed.append(f"{info.name}: {type(err).__name__}: {err}")
if sys.argv[1] == "free" and "triton" in sys.modules:
    failed.append("triton was imported by importing every megalite module")
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


@pytest.mark.parametrize("triton_state", ["blocked", "free"])
def test_every_megalite_module_imports_without_triton(triton_state: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _IMPORT_EVERY_MODULE, triton_state],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr

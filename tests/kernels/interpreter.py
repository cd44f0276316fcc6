"""Run megalite's Triton kernels on CPU tensors through triton's interpreter, in any test.

triton jits its standard library (tl.sum, tl.max, ...) when it is imported, in the mode
TRITON_INTERPRET gives at that moment, so it must be imported with the variable set. The variable
itself must not stay set for the whole session: megalite.core.fusions reads it at every call and
would send every CPU model of every other test through the (slow) interpreter. Hence:

    from tests.kernels.interpreter import use_triton_interpreter

    def test_something(monkeypatch):
        use_triton_interpreter(monkeypatch)   # fusions now take the Triton path for CPU tensors
"""

from __future__ import annotations

import importlib.util
import os

import pytest


def import_triton_interpreted() -> bool:
    """Import triton with TRITON_INTERPRET=1, then put the variable back. False: not installed."""
    if importlib.util.find_spec("triton") is None:
        return False
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.language  # noqa: F401  (jits the standard library)
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous
    return True


def use_triton_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Set TRITON_INTERPRET=1 for one test; skip if triton is missing, fail if it cannot run."""
    if not import_triton_interpreted():
        pytest.skip("triton is not installed: the fused kernels cannot run")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from megalite.kernels import runtime

    if not runtime.triton_available():
        pytest.skip("triton is too old for megalite's kernels")
    reason = runtime.mode_mismatch()
    if reason is not None:
        pytest.fail(f"fused kernels cannot run under the interpreter: {reason}")

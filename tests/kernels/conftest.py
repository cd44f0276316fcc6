"""Every test in this folder runs the Triton kernels on CPU tensors through triton's interpreter.

triton is imported interpreted here, before the test modules are collected, and TRITON_INTERPRET is
set per test only (see interpreter.py for why it must not stay set for the session).
"""

from __future__ import annotations

import pytest

from tests.kernels.interpreter import import_triton_interpreted, use_triton_interpreter

import_triton_interpreted()


@pytest.fixture(autouse=True)
def triton_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    use_triton_interpreter(monkeypatch)

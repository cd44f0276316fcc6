"""What the kernel launchers share: is triton usable, block sizes, how many programs to launch.

No megalite module imports triton at import time. The Triton source lives in builder functions
of _softmax_kernels.py and _norm_kernels.py, which import triton and are called by the launchers on
first use, after ``require_mode_match``. triton >= 3.0 is required, as pyproject's ``triton`` extra
says (checked with 3.9; older releases are refused, not trusted).
"""

from __future__ import annotations

import functools
import logging
import os

import torch

logger = logging.getLogger(__name__)

MIN_TRITON_VERSION = (3, 0)
# The dtypes the kernels read and write; statistics are always fp32 inside.
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split("+")[0].split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


@functools.cache
def triton_available() -> bool:
    """True when triton imports and is new enough for these kernels (checked once per process)."""
    try:
        import triton
    except ImportError:
        return False
    if _version_tuple(triton.__version__) < MIN_TRITON_VERSION:
        logger.warning(
            "triton %s is older than %s: the fused kernels are off, the PyTorch reference serves "
            "(fix: pip install 'triton>=%s')",
            triton.__version__,
            ".".join(map(str, MIN_TRITON_VERSION)),
            ".".join(map(str, MIN_TRITON_VERSION)),
        )
        return False
    return True


@functools.cache
def _stdlib_interpreted() -> bool:
    """Whether triton's standard library (tl.sum, tl.max, ...) was jitted for the interpreter.

    triton decorates those functions when it is imported, in the mode TRITON_INTERPRET gives then.
    """
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.sum, InterpretedFunction)


def mode_mismatch() -> str | None:
    """None when the kernels can run in the current mode, else a one-line reason and fix."""
    if _stdlib_interpreted() == interpreting():
        return None
    if interpreting():
        return (
            "TRITON_INTERPRET=1 was set after triton was imported, so triton's standard library is "
            "compiled-only and the interpreter cannot run it; set TRITON_INTERPRET=1 before "
            "anything imports triton"
        )
    return (
        "triton was imported with TRITON_INTERPRET=1 and the variable is now unset: its standard "
        "library is interpreter-only; keep TRITON_INTERPRET=1 or import triton without it"
    )


@functools.cache
def _warn_once(message: str) -> None:
    logger.warning("fused kernels off, the PyTorch reference serves: %s", message)


def kernels_ready() -> bool:
    """triton is usable and was imported in the mode TRITON_INTERPRET asks for now."""
    if not triton_available():
        return False
    reason = mode_mismatch()
    if reason is not None:
        _warn_once(reason)
        return False
    return True


def require_mode_match() -> None:
    reason = mode_mismatch()
    if reason is not None:
        raise RuntimeError(f"megalite.kernels: {reason}")


def interpreting() -> bool:
    """True when ``TRITON_INTERPRET=1``: the kernels then run on CPU tensors through numpy."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def kernel_device_ok(x: torch.Tensor) -> bool:
    """The kernels can read x: it is on CUDA, or the interpreter is on (CPU tensors)."""
    return x.is_cuda or interpreting()


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def block_for(n: int, cap: int) -> tuple[int, int]:
    """(BLOCK, NUM_BLOCKS) for rows of n elements: one register block when n <= cap, else a loop."""
    block = min(max(next_power_of_2(n), 16), cap)  # >= 16 lanes: tiny rows stay well-formed
    return block, -(-n // block)


def rows_per_program(block: int, num_blocks: int) -> int:
    """Whole rows one program takes as a [rows, BLOCK] tile: short rows share a program, up to
    ~2K elements a tile (a hidden size of 32 puts 64 rows in one program, 1024 two, 2048 and
    longer one, as before). Fewer, fuller programs use a GPU's lanes on short rows, and under the
    interpreter, which runs programs one after another at a fixed cost each, they are most of the
    speed. Looping (multi-block) rows are one per program."""
    if num_blocks > 1:
        return 1
    return max(1, min(64, 2048 // block))


def num_warps_for(block: int) -> int:
    """Warps per program: enough threads that each holds <= ~32 elements of a row block."""
    if block <= 1024:
        return 4
    if block <= 4096:
        return 8
    return 16


def reduction_programs(rows: int, device: torch.device) -> int:
    """How many programs share the rows of a two-stage reduction (each writes one partial row).

    On CUDA two per SM keep every SM busy while the partials (# [G, n] fp32, written once and summed
    once) stay a few percent of the traffic; under the interpreter programs run one after another,
    so a handful is enough to exercise the reduction.
    """
    if device.type == "cuda":
        return max(1, min(rows, 2 * _sm_count(device.index)))
    return max(1, min(rows, 4))


@functools.cache
def _sm_count(index: int | None) -> int:
    return torch.cuda.get_device_properties(index or 0).multi_processor_count

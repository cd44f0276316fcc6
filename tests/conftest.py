from __future__ import annotations

import logging
import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

# triton jits its standard library at import in the mode TRITON_INTERPRET has then: import it in
# interpreter mode before any test module can, so the CPU kernel tests never see a compiled-mode
# triton whatever the collection order (the variable itself is restored at once).
from tests.kernels.interpreter import import_triton_interpreted  # noqa: E402

import_triton_interpreted()


def pytest_sessionfinish(session, exitstatus):
    from tests.harness import shutdown_pools

    shutdown_pools()


@pytest.fixture(autouse=True)
def _restore_megalite_logger():
    """``pretrain()`` run in-process installs its stdout handler on the ``megalite`` logger and
    stops propagation (right for a real run); put the logger back after each test so later tests'
    ``caplog`` sees megalite's records whatever the order."""
    logger = logging.getLogger("megalite")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    yield
    logger.handlers[:] = saved[0]
    logger.setLevel(saved[1])
    logger.propagate = saved[2]


@pytest.fixture(autouse=True)
def _no_process_group_left_behind(request):
    """A test that leaves torch.distributed initialized in the pytest process fails itself, and
    the group is destroyed, instead of an unrelated later test seeing a world it never built."""
    import torch.distributed as dist

    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail(f"{request.node.nodeid} left the default process group initialized")

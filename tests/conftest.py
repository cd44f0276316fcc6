from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

# triton jits its standard library at import in the mode TRITON_INTERPRET has then: import it in
# interpreter mode before any test module can, so the CPU kernel tests never see a compiled-mode
# triton whatever the collection order (the variable itself is restored at once).
from tests.kernels.interpreter import import_triton_interpreted  # noqa: E402

import_triton_interpreted()


def pytest_sessionfinish(session, exitstatus):
    from tests.harness import shutdown_pools

    shutdown_pools()

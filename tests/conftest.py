from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_sessionfinish(session, exitstatus):
    from tests.harness import shutdown_pools

    shutdown_pools()

"""Imported once by the test harness's fork server (``tests/harness.py``), so that every pooled
worker forked from it starts with torch, torch._dynamo and megalite loaded: a spawned worker spent
3-6 s of CPU on these imports, N times per pool. Only imports (no threads, no process group, no
tensor op) so that forking afterwards is safe."""

from __future__ import annotations

import torch  # noqa: F401
import torch.distributed  # noqa: F401

try:  # the first optimizer step of every training case imports it (about half the import time)
    import torch._dynamo  # noqa: F401
except Exception:  # noqa: BLE001 - a worker imports it itself then
    pass

try:
    import megalite.training.pretrain  # noqa: F401
    import tests.training.common  # noqa: F401
except Exception:  # noqa: BLE001 - a broken import shows in the case that needs it, with its rank
    pass

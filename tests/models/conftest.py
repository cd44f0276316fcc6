from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _restore_global_rng():
    """Model tests (HF model construction, RNG trackers) consume or reseed torch's global
    generator; give it back unchanged so no other test depends on the order tests run in."""
    with torch.random.fork_rng():
        yield

"""Layout-independent initialisation.

A weight is initialised in full, on CPU in fp32, from a generator keyed by (seed, parameter name),
then each rank keeps its slice. The numbers therefore depend neither on the TP or PP layout nor on
the order in which layers are built, so TP=4 and TP=1 (and a pipeline stage alone) start identical.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable

import torch

InitMethod = Callable[[torch.Tensor], None]


def keyed_generator(seed: int, key: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}/{key}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") % (2**63))


def init_normal(std: float, *, seed: int, key: str) -> InitMethod:
    """``N(0, std^2)`` from the generator of (seed, key)."""

    def init(weight: torch.Tensor) -> None:
        with torch.no_grad():
            weight.normal_(0.0, std, generator=keyed_generator(seed, key))

    return init


def init_scaled_normal(std: float, num_layers: int, *, seed: int, key: str) -> InitMethod:
    """Megatron's output-projection init: ``std / sqrt(2 * num_layers)``."""
    return init_normal(std / math.sqrt(2.0 * num_layers), seed=seed, key=key)


def default_init(weight: torch.Tensor) -> None:
    """Fallback when a layer is given no init_method: N(0, 0.02^2) from torch's default generator
    (identical across ranks only if they share the seed)."""
    with torch.no_grad():
        weight.normal_(0.0, 0.02)

"""megalite: Megatron-style 3D-parallel GPT pretraining on PyTorch."""

from __future__ import annotations

__version__ = "0.1.0"

"""megalite: Megatron-style 3D-parallel GPT pretraining on PyTorch."""

from __future__ import annotations

from megalite.inference import load_model

__version__ = "0.1.0"
__all__ = ["load_model"]

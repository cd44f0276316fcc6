"""megalite: Megatron-style 3D-parallel GPT pretraining on PyTorch."""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["load_model"]


def __getattr__(name: str):
    # lazy, so `import megalite.data` (the preprocessing tool and its workers) does not import torch
    if name == "load_model":
        from megalite.inference import load_model

        return load_model
    raise AttributeError(f"module 'megalite' has no attribute {name!r}")

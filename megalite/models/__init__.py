"""The GPT model (GPT-2 and Llama families), built only from megalite.core layers."""

from megalite.models.config import GPTConfig
from megalite.models.gpt import GPTModel

__all__ = ["GPTConfig", "GPTModel"]

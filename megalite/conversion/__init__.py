"""Conversion between megalite checkpoints and HuggingFace models (GPT-2, Llama, Mistral, Qwen2,
Mixtral, Qwen2-MoE).

    hf_dir = export_to_hf("checkpoints/run1", "hf/run1")          # -> GPT2LMHeadModel / Llama...
    import_from_hf("hf/gpt2", "checkpoints/from_hf", tp_size=2)   # -> a megalite checkpoint

Both go through the logical form (full tensors keyed by global megalite name, unpadded vocabulary),
``megalite.load_model`` on the way out (``exporting``) and ``megalite_files.write_checkpoint`` on
the way in (``importing``). ``families`` decides the family from the model's flags; one module per
family maps names, layouts and the config (``gpt2``, ``llama``, ``mistral``, ``mixtral``,
``qwen2_moe``); ``hf_files`` reads and writes HF's files; ``flags`` gives the ``pretrain_gpt.py``
flags of a model. transformers, safetensors and sentencepiece are optional and heavy: the
functions that need them import them.
"""

from __future__ import annotations

from megalite.conversion.errors import ConversionError
from megalite.conversion.exporting import export_to_hf, hf_logit_difference
from megalite.conversion.families import family_of
from megalite.conversion.flags import megalite_flags
from megalite.conversion.importing import import_from_hf

__all__ = [
    "ConversionError",
    "export_to_hf",
    "family_of",
    "hf_logit_difference",
    "import_from_hf",
    "megalite_flags",
]

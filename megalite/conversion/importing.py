"""HuggingFace folder -> megalite checkpoint: ``import_from_hf``.

The family's ``config_from_hf`` and ``from_hf`` give the model's GPTConfig and its logical tensors;
``megalite_files.write_checkpoint`` cuts them into a ``release`` checkpoint of any TP x PP layout,
written into a hidden sibling of ``--save`` and moved into place when complete (``staging``): a
failed import leaves no folder behind and changes no folder the user had.
"""

from __future__ import annotations

import os

from megalite.checkpoint.files import TRACKER_FILE
from megalite.conversion.errors import ConversionError
from megalite.conversion.families import FAMILIES, HF_MODEL_TYPES
from megalite.conversion.hf_files import load_hf_config, load_hf_weights
from megalite.conversion.megalite_files import write_checkpoint
from megalite.conversion.staging import staged_folder
from megalite.errors import path_problem
from megalite.models.config import GPTConfig

LAST = (TRACKER_FILE,)  # moved into an existing --save folder last: it points at the release


def import_from_hf(
    hf_dir: str,
    save_dir: str,
    *,
    tp_size: int = 1,
    pp_size: int = 1,
    make_vocab_size_divisible_by: int = 128,
) -> tuple[GPTConfig, str]:
    """A local HF folder of a family megalite converts -> a megalite ``release`` checkpoint under
    TP x PP.
    Returns (the model's GPTConfig, the iteration directory)."""
    with staged_folder(save_dir, flag="--save", what="megalite checkpoint", last=LAST) as work:
        hf_config = load_hf_config(hf_dir)
        family = HF_MODEL_TYPES.get(hf_config.model_type)
        if family is None:
            raise ConversionError(
                f"{hf_dir}: model_type {hf_config.model_type!r} is not supported; megalite "
                "converts " + ", ".join(HF_MODEL_TYPES)
            )
        module = FAMILIES[family]
        config = module.config_from_hf(hf_config)
        config.make_vocab_size_divisible_by = make_vocab_size_divisible_by
        state = module.from_hf(load_hf_weights(hf_dir), config)
        has_tokenizer = any(
            os.path.isfile(os.path.join(hf_dir, n)) for n in ("tokenizer.json", "tokenizer.model")
        )
        data = {
            "tokenizer_type": "HuggingFaceTokenizer",
            "tokenizer_model": os.path.abspath(hf_dir),
        }
        extra = {
            "converted_from": os.path.abspath(hf_dir),
            "data": data if has_tokenizer else {},
            "tokenizer": {"eod": hf_config.eos_token_id, "bos": hf_config.bos_token_id},
        }
        try:
            written = write_checkpoint(
                state, config, work, tp_size=tp_size, pp_size=pp_size, extra_record=extra
            )
        except OSError as e:  # a full disk
            raise ConversionError(
                f"--save {save_dir}: cannot write the checkpoint ({path_problem(e)}); nothing was "
                "kept; free space or choose another folder"
            ) from None
    iter_dir = os.path.join(save_dir, os.path.relpath(written, work))
    return config, iter_dir

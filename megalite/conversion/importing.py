"""HuggingFace folder -> megalite checkpoint: ``import_from_hf``.

The family's ``config_from_hf`` and ``from_hf`` give the model's GPTConfig and its logical tensors;
``megalite_files.write_checkpoint`` cuts them into a ``release`` checkpoint of any TP x PP layout.
"""

from __future__ import annotations

import os
import shutil

from megalite.checkpoint.files import RELEASE, read_tracker
from megalite.conversion.errors import ConversionError
from megalite.conversion.families import FAMILIES, HF_MODEL_TYPES
from megalite.conversion.hf_files import load_hf_config, load_hf_weights
from megalite.conversion.megalite_files import write_checkpoint
from megalite.errors import UserError, check_writable_dir, path_problem
from megalite.models.config import GPTConfig


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
    check_writable_dir(save_dir, flag="--save", what="megalite checkpoint")
    hf_config = load_hf_config(hf_dir)
    family = HF_MODEL_TYPES.get(hf_config.model_type)
    if family is None:
        raise ConversionError(
            f"{hf_dir}: model_type {hf_config.model_type!r} is not supported; megalite converts "
            + ", ".join(HF_MODEL_TYPES)
        )
    module = FAMILIES[family]
    config = module.config_from_hf(hf_config)
    config.make_vocab_size_divisible_by = make_vocab_size_divisible_by
    state = module.from_hf(load_hf_weights(hf_dir), config)
    has_tokenizer = any(
        os.path.isfile(os.path.join(hf_dir, n)) for n in ("tokenizer.json", "tokenizer.model")
    )
    data = {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": os.path.abspath(hf_dir)}
    extra = {
        "converted_from": os.path.abspath(hf_dir),
        "data": data if has_tokenizer else {},
        "tokenizer": {"eod": hf_config.eos_token_id, "bos": hf_config.bos_token_id},
    }
    try:
        iter_dir = write_checkpoint(
            state, config, save_dir, tp_size=tp_size, pp_size=pp_size, extra_record=extra
        )
    except (UserError, OSError) as e:  # a full disk: no half-written release stays behind
        if read_tracker(save_dir) != RELEASE:
            shutil.rmtree(os.path.join(save_dir, RELEASE), ignore_errors=True)
        if isinstance(e, UserError):
            raise
        raise ConversionError(
            f"--save {save_dir}: cannot write the checkpoint ({path_problem(e)}); nothing was "
            "kept; free space or choose another folder"
        ) from None
    return config, iter_dir

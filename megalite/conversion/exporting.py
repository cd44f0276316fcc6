"""megalite checkpoint -> HuggingFace folder (``export_to_hf``), checked by ``hf_logit_difference``.

The model goes through ``megalite.load_model`` (any layout -> one CPU model in fp32), its logical
tensors through the family's ``to_hf``; weights as safetensors, ``config.json``,
``generation_config.json`` and the run's tokenizer when it is known, written into a hidden sibling
of the folder and moved into place when all is written (``staging``): a failed export leaves no
folder behind.
"""

from __future__ import annotations

import torch

from megalite.conversion.errors import ConversionError
from megalite.conversion.families import FAMILIES, family_of
from megalite.conversion.hf_files import (
    save_generation_config,
    save_safetensors,
    save_tokenizer_files,
)
from megalite.conversion.staging import staged_folder
from megalite.errors import path_problem
from megalite.inference import load_model

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
LAST = ("config.json",)  # moved into an existing --save folder last: it makes the folder loadable


def export_to_hf(
    load_dir: str,
    hf_dir: str,
    *,
    iteration: int | str | None = None,
    dtype: str = "auto",
    max_shard_size: int = 5 * 10**9,
) -> dict:
    """Write the model of a megalite checkpoint (any layout) as a HuggingFace folder: weights,
    ``config.json``, ``generation_config.json`` and the run's tokenizer when it is known. Returns
    ``{"family", "files", "tokenizer_files", "model"}`` (``model``: the ``load_model`` result)."""
    with staged_folder(hf_dir, flag="--save", what="HuggingFace model", last=LAST) as work:
        model = load_model(load_dir, iteration)
        config = model.config
        family = family_of(config)
        record = model.checkpoint_info["config"]
        tokenizer = record.get("tokenizer", {})
        eos = tokenizer.get("eod")
        bos = tokenizer.get("bos", eos)
        if dtype == "auto":
            target = getattr(torch, str(record["model"]["params_dtype"]).removeprefix("torch."))
        elif dtype in DTYPES:
            target = DTYPES[dtype]
        else:
            raise ConversionError(f"--dtype {dtype!r}: use auto, fp32, bf16 or fp16")
        module = FAMILIES[family]
        state = {k: v.detach() for k, v in model.state_dict().items()}
        hf_state = {k: v.to(target) for k, v in module.to_hf(state, config).items()}
        try:
            files = save_safetensors(hf_state, work, max_shard_bytes=max_shard_size)
            hf_config = module.hf_config(config, bos_token_id=bos, eos_token_id=eos)
            # transformers >= 4.56 names the weights' dtype ``dtype``, older ones ``torch_dtype``
            setattr(hf_config, "dtype" if hasattr(hf_config, "dtype") else "torch_dtype", target)
            hf_config.save_pretrained(work)
            save_generation_config(work, bos_token_id=bos, eos_token_id=eos)
            tokenizer_files = save_tokenizer_files(
                record.get("data", {}), work, max_length=config.seq_length, eos_token_id=eos
            )
        except OSError as e:
            raise ConversionError(
                f"--save {hf_dir}: cannot write the HuggingFace model ({path_problem(e)}); free "
                "space or choose another folder"
            ) from None
    return {"family": family, "files": files, "tokenizer_files": tokenizer_files, "model": model}


def hf_logit_difference(
    hf_dir: str, model: torch.nn.Module, *, batch_size: int = 2, seq_length: int = 32, seed: int = 0
) -> float:
    """The largest |logit difference| between the HF model in ``hf_dir`` (loaded in fp32 with
    transformers) and ``model`` (``load_model``'s) on one fixed random batch of token ids."""
    import transformers

    seq_length = min(seq_length, model.config.max_position_embeddings)
    try:
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            hf_dir, local_files_only=True, dtype=torch.float32
        )
    except TypeError:  # transformers < 4.56 names it torch_dtype
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            hf_dir, local_files_only=True, torch_dtype=torch.float32
        )
    hf.eval()
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, model.config.vocab_size, (batch_size, seq_length), generator=g)
    with torch.no_grad():
        ours = model(tokens)
        theirs = hf(input_ids=tokens).logits
    if ours.shape != theirs.shape:
        raise ConversionError(
            f"logits of shape {tuple(theirs.shape)}, expected {tuple(ours.shape)}"
        )
    return float((ours - theirs).abs().max())

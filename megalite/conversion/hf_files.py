"""Reading and writing HuggingFace model folders: safetensors weights (sharded above a size),
config / generation config, and tokenizer files.

Nothing here downloads anything: folders are local, ``transformers`` is used only to write and
read its config classes (``local_files_only``).
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import shutil

import torch

from megalite.conversion.errors import ConversionError
from megalite.errors import one_line

logger = logging.getLogger(__name__)

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
)
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
}


def parse_size(text: str | int) -> int:
    """``"5GB"``, ``"500MiB"``, ``1000000`` -> bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", text)
    if m is None or m.group(2).upper() not in _UNITS:
        raise ConversionError(f"--max-shard-size {text!r}: use a size such as 5GB or 500MB")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def save_safetensors(
    state: dict[str, torch.Tensor], hf_dir: str, *, max_shard_bytes: int
) -> list[str]:
    """Write ``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` plus the index when
    the weights exceed ``max_shard_bytes``; earlier weight files in ``hf_dir`` are removed first.
    Returns the files written."""
    from safetensors.torch import save_file

    os.makedirs(hf_dir, exist_ok=True)
    for old in glob.glob(os.path.join(hf_dir, "model*.safetensors*")):
        os.remove(old)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor.detach().contiguous().clone()
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], os.path.join(hf_dir, SAFETENSORS), metadata={"format": "pt"})
        return [SAFETENSORS]
    files, weight_map, total = [], {}, 0
    for i, shard in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(hf_dir, name), metadata={"format": "pt"})
        files.append(name)
        for key, t in shard.items():
            weight_map[key] = name
            total += t.numel() * t.element_size()
    with open(os.path.join(hf_dir, SAFETENSORS_INDEX), "w", encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return [*files, SAFETENSORS_INDEX]


def load_hf_weights(hf_dir: str) -> dict[str, torch.Tensor]:
    """Every tensor of a local HF folder: safetensors (single or indexed) or pytorch_model.bin."""
    from safetensors.torch import load_file

    def from_index(index: str, loader) -> dict[str, torch.Tensor]:
        with open(os.path.join(hf_dir, index), encoding="utf-8") as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        out: dict[str, torch.Tensor] = {}
        for name in files:
            out.update(loader(os.path.join(hf_dir, name)))
        return out

    def torch_load(path: str) -> dict[str, torch.Tensor]:
        return torch.load(path, map_location="cpu", weights_only=True)

    sources = (
        (SAFETENSORS, lambda: load_file(os.path.join(hf_dir, SAFETENSORS))),
        (SAFETENSORS_INDEX, lambda: from_index(SAFETENSORS_INDEX, load_file)),
        ("pytorch_model.bin", lambda: torch_load(os.path.join(hf_dir, "pytorch_model.bin"))),
        ("pytorch_model.bin.index.json", lambda: from_index(BIN_INDEX, torch_load)),
    )
    for name, load in sources:
        if os.path.isfile(os.path.join(hf_dir, name)):
            try:
                return load()
            except Exception as e:  # noqa: BLE001 - safetensors, json, torch: a bad file
                raise ConversionError(
                    f"--load {hf_dir}: cannot read {name} or a file it names ({type(e).__name__}: "
                    f"{one_line(str(e))[:160]}); the folder is truncated or corrupt"
                ) from None
    raise ConversionError(
        f"{hf_dir} holds no {SAFETENSORS}, {SAFETENSORS_INDEX} or pytorch_model.bin; is it a "
        "HuggingFace model folder?"
    )


def load_hf_config(hf_dir: str):
    """The folder's ``config.json`` as a transformers config object (no download)."""
    import transformers

    if not os.path.isfile(os.path.join(hf_dir, "config.json")):
        raise ConversionError(f"{hf_dir} has no config.json; is it a HuggingFace model folder?")
    try:
        return transformers.AutoConfig.from_pretrained(hf_dir, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ConversionError(
            f"--load {hf_dir}: cannot read config.json ({one_line(str(e))[:160]}); is it a "
            "HuggingFace model folder?"
        ) from None


def save_generation_config(hf_dir: str, *, bos_token_id, eos_token_id) -> None:
    import transformers

    transformers.GenerationConfig(
        bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=eos_token_id
    ).save_pretrained(hf_dir)


def _sentencepiece_tokenizer(model_path: str, hf_dir: str, *, max_length: int) -> None:
    """A SentencePiece ``.model`` as ``tokenizer.model`` + the config ``LlamaTokenizer`` loads.
    No BOS/EOS is added when encoding, as megalite's tokenizer (and its training data) do."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=model_path)

    def piece(i: int) -> str | None:
        return sp.id_to_piece(i) if i >= 0 else None

    shutil.copyfile(model_path, os.path.join(hf_dir, "tokenizer.model"))
    config = {
        "tokenizer_class": "LlamaTokenizer",
        "bos_token": piece(sp.bos_id()),
        "eos_token": piece(sp.eos_id()),
        "unk_token": piece(sp.unk_id()),
        "pad_token": piece(sp.pad_id()),
        "add_bos_token": False,
        "add_eos_token": False,
        "legacy": True,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
    }
    with open(os.path.join(hf_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({k: v for k, v in config.items() if v is not None}, f, indent=2)


def save_tokenizer_files(
    data_config: dict, hf_dir: str, *, max_length: int, eos_token_id: int | None = None
) -> list[str]:
    """Put the run's tokenizer in ``hf_dir`` (``data_config``: the checkpoint's recorded data
    flags). SentencePiece: ``tokenizer.model`` + ``tokenizer_config.json`` (LlamaTokenizer);
    HuggingFace: its files copied. Returns the files written ([] for NullTokenizer, or when the
    tokenizer file is gone, with a warning)."""
    kind, path = data_config.get("tokenizer_type"), data_config.get("tokenizer_model")
    if kind == "NullTokenizer" or not path:
        logger.info("the run used %s: no tokenizer files to write", kind or "no tokenizer")
        return []
    if not os.path.exists(path):
        logger.warning(
            "the run's tokenizer %s is not there any more: no tokenizer files written; copy "
            "them into %s yourself",
            path,
            hf_dir,
        )
        return []
    if kind == "TikTokenizer":
        logger.warning("the run used TikTokenizer: no HuggingFace tokenizer files written")
        return []
    if kind in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"):
        _sentencepiece_tokenizer(path, hf_dir, max_length=max_length)
        return ["tokenizer.model", "tokenizer_config.json"]
    if os.path.isdir(path):
        copied = [n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(path, n))]
        for name in copied:
            shutil.copyfile(os.path.join(path, name), os.path.join(hf_dir, name))
        return copied
    shutil.copyfile(path, os.path.join(hf_dir, "tokenizer.json"))  # a lone tokenizer.json
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length}
    if eos_token_id is not None:
        from tokenizers import Tokenizer

        config["eos_token"] = Tokenizer.from_file(path).id_to_token(eos_token_id)
    with open(os.path.join(hf_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    return ["tokenizer.json", "tokenizer_config.json"]

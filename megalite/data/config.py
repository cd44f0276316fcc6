"""DataConfig: the data flags of ``pretrain_gpt.py`` as one validated dataclass.

Flag names follow Megatron-LM (``--data-path``, ``--split``, ``--data-cache-path``, ``--mock-data``,
``--tokenizer-type``, ``--tokenizer-model``, ``--vocab-size``, ``--num-workers``,
``--eod-mask-loss``). The sample length and the seed of the data order are the model's
(``GPTConfig.seq_length``, ``GPTConfig.seed``): the builders take them as arguments.
``validate()`` refuses bad combinations with one-line ValueErrors that name the flag, the value and
the fix; it touches no file except to check that named files exist.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

TOKENIZER_TYPES = (
    "NullTokenizer",
    "GPT2BPETokenizer",
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "Llama2Tokenizer",
    "TikTokenizer",
    "HuggingFaceTokenizer",
)


@dataclass
class DataConfig:
    data_path: list[str] | None = None  # Megatron's --data-path: [prefix] or [w1, p1, w2, p2, ...]
    split: str = "969,30,1"
    train_data_path: list[str] | None = None
    valid_data_path: list[str] | None = None
    test_data_path: list[str] | None = None
    data_cache_path: str | None = None
    mock_data: bool = False
    tokenizer_type: str = "NullTokenizer"  # NullTokenizer | SentencePieceTokenizer | HuggingFace...
    tokenizer_model: str | None = None
    vocab_size: int | None = None  # NullTokenizer; TikTokenizer (default 131072)
    vocab_file: str | None = None  # GPT2BPETokenizer: vocab.json
    merge_file: str | None = None  # GPT2BPETokenizer: merges.txt
    tiktoken_pattern: str | None = None  # TikTokenizer: v1 | v2
    tiktoken_num_special_tokens: int = 1000  # TikTokenizer
    num_workers: int = 0
    eod_mask_loss: bool = False  # --eod-mask-loss: no loss on eod tokens
    # documents inside a sample (gpt_dataset.get_ltor_masks_and_position_ids)
    reset_position_ids: bool = False  # positions restart after each eod
    reset_attention_mask: bool = False  # attention does not cross an eod

    def validate(self) -> None:
        """Raise a one-line ValueError for the first bad setting; return None when all are good."""
        if self.tokenizer_type not in TOKENIZER_TYPES:
            raise ValueError(
                f"--tokenizer-type {self.tokenizer_type!r} is not supported; "
                f"use one of {', '.join(TOKENIZER_TYPES)}"
            )
        if self.tokenizer_type == "NullTokenizer":
            if self.vocab_size is None or int(self.vocab_size) < 1:
                raise ValueError(
                    f"--tokenizer-type NullTokenizer needs --vocab-size V >= 1 (got "
                    f"{self.vocab_size}); ids are 0..V-1 and eod is V"
                )
        elif self.tokenizer_type == "GPT2BPETokenizer":
            for flag, path in (
                ("--vocab-file", self.vocab_file),
                ("--merge-file", self.merge_file),
            ):
                if not path or not os.path.isfile(path):
                    raise ValueError(
                        f"--tokenizer-type GPT2BPETokenizer needs {flag} (vocab.json, "
                        f"merges.txt); {path} is not a file"
                    )
        else:
            if not self.tokenizer_model:
                raise ValueError(
                    f"--tokenizer-type {self.tokenizer_type} needs --tokenizer-model "
                    "(a .model file for SentencePiece; tokenizer.json or its folder for "
                    "HuggingFace)"
                )
            if not os.path.exists(self.tokenizer_model):
                raise ValueError(
                    f"--tokenizer-model {self.tokenizer_model}: no such file or folder"
                )
        if not isinstance(self.num_workers, int) or self.num_workers < 0:
            raise ValueError(f"--num-workers must be an integer >= 0, got {self.num_workers!r}")
        per_split = [self.train_data_path, self.valid_data_path, self.test_data_path]
        if self.mock_data:
            if self.data_path or any(per_split):
                raise ValueError(
                    "--mock-data and --data-path/--train-data-path are mutually exclusive; "
                    "drop one of them"
                )
            return
        if self.data_path and any(per_split):
            raise ValueError(
                "--data-path and --train-data-path/--valid-data-path/--test-data-path are "
                "mutually exclusive; use --data-path with --split, or the three per-split paths"
            )
        if not self.data_path and not self.train_data_path:
            raise ValueError(
                "no data: pass --data-path PREFIX (or --train-data-path PREFIX), "
                "or --mock-data for a smoke test"
            )
        if self.data_path:
            parse_split(self.split)
            parse_blend(self.data_path, flag="--data-path")
        for flag, paths in zip(
            ("--train-data-path", "--valid-data-path", "--test-data-path"), per_split
        ):
            if paths:
                parse_blend(paths, flag=flag)


def parse_split(split: str) -> tuple[float, float, float]:
    """Megatron's ``--split``: "969,30,1" or "98/2/0" -> normalised (train, valid, test) weights.

    Missing entries are 0 ("99,1" -> test gets nothing); weights are >= 0 with a positive sum.
    """
    parts = [p.strip() for p in split.replace("/", ",").split(",")]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise ValueError(
            f"--split {split!r} is not a list of numbers; write it like 969,30,1"
        ) from None
    if len(values) > 3 or any(v < 0 for v in values) or sum(values) <= 0:
        raise ValueError(
            f"--split {split!r} needs 1 to 3 non-negative weights with a positive sum "
            "(train,valid,test), e.g. 969,30,1"
        )
    values += [0.0] * (3 - len(values))
    total = sum(values)
    return (values[0] / total, values[1] / total, values[2] / total)


def parse_blend(
    paths: list[str], *, flag: str = "--data-path"
) -> tuple[list[str], list[float] | None]:
    """``[prefix]``, ``[p1, p2, ...]`` or ``[w1, p1, w2, p2, ...]`` -> (prefixes, weights or None).

    Weights are returned unnormalised; None means "no weights given" (the caller weighs the datasets
    by their token counts). Each prefix must name an existing ``PREFIX.idx`` and ``PREFIX.bin``.
    """
    if not paths:
        raise ValueError(f"{flag} is empty; give a dataset prefix or 'weight prefix' pairs")
    weights: list[float] | None = None
    prefixes = list(paths)
    if _is_number(paths[0]):
        if len(paths) % 2:
            raise ValueError(
                f"{flag} has {len(paths)} entries, starting with a weight: write "
                "'w1 prefix1 w2 prefix2 ...' (an even count)"
            )
        weights = []
        prefixes = []
        for w, p in zip(paths[0::2], paths[1::2]):
            if not _is_number(w):
                raise ValueError(f"{flag}: expected a weight before {p!r}, got {w!r}")
            if float(w) <= 0:
                raise ValueError(
                    f"{flag}: weight {w} for {p} must be > 0; drop the dataset instead"
                )
            weights.append(float(w))
            prefixes.append(p)
    for p in prefixes:
        if _is_number(p):
            raise ValueError(f"{flag}: {p!r} looks like a weight where a dataset prefix belongs")
        for ext in (".idx", ".bin"):
            if not os.path.isfile(p + ext):
                raise ValueError(
                    f"{flag}: {p + ext} does not exist; a prefix P names P.bin and P.idx "
                    "(tools/preprocess_data.py writes {output_prefix}_{key}_document.bin/.idx)"
                )
    return prefixes, weights


def read_data_args(path: str) -> list[str]:
    """Megatron's ``--data-args-path`` file: the ``--data-path`` list written in a file, entries
    separated by any whitespace (``"0.3 /d/a 0.7 /d/b"``, one per line or not)."""
    try:
        with open(path, encoding="utf-8") as f:
            entries = f.read().split()
    except OSError as e:
        raise ValueError(f"--data-args-path {path}: cannot read it ({e.strerror})") from None
    if not entries:
        raise ValueError(f"--data-args-path {path} is empty; write the --data-path list in it")
    return entries


def read_per_split_data_args(path: str) -> tuple[list[str] | None, ...]:
    """Megatron's ``--per-split-data-args-path`` file: JSON ``{"train": ..., "valid": ...,
    "test": ...}``, each value a list of entries or one whitespace-separated string (a blend as
    ``--train-data-path`` takes it) -> (train, valid, test); a missing, null or empty valid or
    test entry is None (no such split)."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except OSError as e:
        raise ValueError(
            f"--per-split-data-args-path {path}: cannot read it ({e.strerror})"
        ) from None
    except json.JSONDecodeError as e:
        raise ValueError(
            f"--per-split-data-args-path {path}: not JSON ({e.msg}, line {e.lineno}); write "
            '{"train": [...], "valid": [...], "test": [...]}'
        ) from None
    if not isinstance(doc, dict) or not doc.get("train"):
        raise ValueError(
            f'--per-split-data-args-path {path}: needs a JSON object with a non-empty "train" '
            'entry: {"train": [...], "valid": [...], "test": [...]}'
        )
    out = []
    for split in ("train", "valid", "test"):
        value = doc.get(split)
        if isinstance(value, str):
            value = value.split()
        if value is not None and not (
            isinstance(value, list) and all(isinstance(v, (str, int, float)) for v in value)
        ):
            raise ValueError(
                f"--per-split-data-args-path {path}: {split!r} must be a list of paths (and "
                f"weights) or one string, got {type(value).__name__}"
            )
        out.append([str(v) for v in value] if value else None)
    return tuple(out)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except (TypeError, ValueError):
        return False
    return True

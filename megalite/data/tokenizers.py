"""Tokenizers: Megatron's NullTokenizer, GPT2BPETokenizer, the SentencePiece ones
(SentencePieceTokenizer, GPTSentencePieceTokenizer, Llama2Tokenizer), TikTokenizer, and
HuggingFace (optional dependency). ``make_tokenizer`` builds one from Megatron's flags.

Every tokenizer offers ``vocab_size`` (unpadded: the model pads it for TP), ``eod`` (the id appended
after each document by ``tools/preprocess_data.py --append-eod`` and masked by ``--eod-mask-loss``),
``tokenize(str) -> list[int]`` and ``detokenize(list[int]) -> str``. Tokenizers are plain picklable
objects so that preprocessing workers can be handed one.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

from megalite.errors import UserError, one_line

if TYPE_CHECKING:
    from megalite.data.config import DataConfig


class TokenizerError(UserError, ValueError):
    """A tokenizer flag or file that cannot be used; one line naming the flag and the file."""


class Tokenizer:
    """The interface; see the module docstring."""

    vocab_size: int
    eod: int

    def tokenize(self, text: str) -> list[int]:
        raise NotImplementedError

    def detokenize(self, ids: list[int]) -> str:
        raise NotImplementedError

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        """Tokenise many texts; subclasses override when their library batches faster."""
        return [self.tokenize(t) for t in texts]


class NullTokenizer(Tokenizer):
    """Megatron's NullTokenizer: text is whitespace-separated integer ids in [0, V).

    ``eod`` is V, so the vocabulary is V + 1 (``vocab_size`` returns V + 1).
    """

    def __init__(self, vocab_size: int):
        if int(vocab_size) < 1:
            raise TokenizerError(f"--vocab-size must be >= 1 for NullTokenizer, got {vocab_size}")
        self._num_ids = int(vocab_size)
        self.eod = self._num_ids
        self.vocab_size = self._num_ids + 1

    def tokenize(self, text: str) -> list[int]:
        words = text.split()
        try:
            ids = list(map(int, words))
        except ValueError:
            bad = next(w for w in words if not _is_int(w))
            raise TokenizerError(
                f"NullTokenizer reads whitespace-separated integer ids, got {bad[:40]!r}"
            ) from None
        if ids and (min(ids) < 0 or max(ids) >= self._num_ids):
            bad = next(i for i in ids if not 0 <= i < self._num_ids)
            raise TokenizerError(
                f"NullTokenizer id {bad} is outside [0, {self._num_ids}) set by --vocab-size "
                f"{self._num_ids}; raise --vocab-size above the largest id"
            )
        return ids

    def detokenize(self, ids: list[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece ``.model`` file; ``eod`` is its eos id (which must be enabled)."""

    def __init__(self, model_path: str):
        import sentencepiece as spm

        if not os.path.isfile(model_path):
            raise TokenizerError(
                f"--tokenizer-model {model_path}: no such SentencePiece .model file"
            )
        self.model_path = model_path
        try:
            self._sp = spm.SentencePieceProcessor(model_file=model_path)
        except (RuntimeError, OSError) as e:  # "could not parse ModelProto from ..."
            raise TokenizerError(
                f"--tokenizer-model {model_path}: not a SentencePiece model "
                f"({one_line(str(e)).replace(f' from {model_path}', '')}); pass the .model file "
                "tools/train_tokenizer.py (or SentencePiece) wrote"
            ) from None
        self.vocab_size = int(self._sp.vocab_size())
        self.bos = _none_if_negative(self._sp.bos_id())
        self.eos = _none_if_negative(self._sp.eos_id())
        self.pad = _none_if_negative(self._sp.pad_id())
        self.unk = _none_if_negative(self._sp.unk_id())
        if self.eos is None:
            raise TokenizerError(
                f"--tokenizer-model {model_path} has no eos piece (eos_id=-1), so there is no eod; "
                "retrain it with an eos id (tools/train_tokenizer.py sets eos_id=2)"
            )
        self.eod = self.eos

    def tokenize(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return self._sp.encode(texts)

    def detokenize(self, ids: list[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def __getstate__(self) -> dict:
        return {"model_path": self.model_path}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["model_path"])


class GPTSentencePieceTokenizer(SentencePieceTokenizer):
    """Megatron's GPTSentencePieceTokenizer: the model's own ids (no pieces added), no bos/eos in
    ``tokenize``, ``eod`` = eos. (megalite's SentencePieceTokenizer has the same ids.)"""


class Llama2Tokenizer(SentencePieceTokenizer):
    """Megatron's Llama2Tokenizer: ``tokenize`` puts the bos id first (no eos), ``eod`` = eos."""

    def __init__(self, model_path: str):
        super().__init__(model_path)
        if self.bos is None:
            raise TokenizerError(
                f"--tokenizer-model {model_path} has no bos piece (bos_id=-1); Llama2Tokenizer "
                "starts every text with it"
            )

    def tokenize(self, text: str) -> list[int]:
        return [self.bos, *self._sp.encode(text)]

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return [[self.bos, *ids] for ids in self._sp.encode(texts)]


class HuggingFaceTokenizer(Tokenizer):
    """A local ``tokenizer.json`` (through ``tokenizers``) or a local folder (through
    ``transformers.AutoTokenizer``, falling back to the folder's tokenizer.json). Nothing is
    downloaded. ``tokenize`` adds the tokenizer's own special tokens (e.g. Llama's BOS), as
    Megatron's HuggingFaceTokenizer does; ``eod`` is the eos token.
    """

    _EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|eot_id|>")

    def __init__(self, model_path: str):
        if not os.path.exists(model_path):
            raise TokenizerError(
                f"--tokenizer-model {model_path}: no such tokenizer.json or folder"
            )
        self.model_path = model_path
        self._hf = None  # transformers tokenizer
        self._tk = None  # tokenizers.Tokenizer
        if os.path.isdir(model_path):
            try:
                from transformers import AutoTokenizer

                self._hf = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
            except (ImportError, OSError, ValueError):
                pass
            if self._hf is None:
                model_path = os.path.join(model_path, "tokenizer.json")
        if self._hf is not None:
            self.vocab_size = len(self._hf)
            eos = self._hf.eos_token_id
            if eos is None:
                vocab = self._hf.get_vocab()
                eos = next((vocab[t] for t in self._EOS_CANDIDATES if t in vocab), None)
        else:
            try:
                from tokenizers import Tokenizer as RawTokenizer
            except ImportError:
                raise ImportError(
                    "HuggingFaceTokenizer needs the 'tokenizers' package: pip install -e .[hf]"
                ) from None
            self._tk = RawTokenizer.from_file(model_path)
            self.vocab_size = self._tk.get_vocab_size(with_added_tokens=True)
            eos = self._eos_from_json(model_path)
        if eos is None:
            raise TokenizerError(
                f"--tokenizer-model {self.model_path} has no eos token (tried "
                f"{', '.join(self._EOS_CANDIDATES)}); add one so the tokenizer has an eod id"
            )
        self.eod = int(eos)

    def _eos_from_json(self, path: str) -> int | None:
        with open(path, encoding="utf-8") as f:
            added = {t["content"]: t["id"] for t in json.load(f).get("added_tokens", [])}
        for name in self._EOS_CANDIDATES:
            tid = added.get(name, self._tk.token_to_id(name))
            if tid is not None:
                return tid
        return None

    def tokenize(self, text: str) -> list[int]:
        if self._hf is not None:
            return list(self._hf(text)["input_ids"])
        return self._tk.encode(text).ids

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        if self._hf is not None:
            return [list(x) for x in self._hf(texts)["input_ids"]]
        return [e.ids for e in self._tk.encode_batch(texts)]

    def detokenize(self, ids: list[int]) -> str:
        if self._hf is not None:
            return self._hf.decode([int(i) for i in ids])
        return self._tk.decode([int(i) for i in ids])

    def __getstate__(self) -> dict:
        return {"model_path": self.model_path}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["model_path"])


TOKENIZER_TYPES = (
    "NullTokenizer", "GPT2BPETokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer",
    "Llama2Tokenizer", "TikTokenizer", "HuggingFaceTokenizer",
)  # fmt: skip
_SENTENCEPIECE = {
    "SentencePieceTokenizer": SentencePieceTokenizer,
    "GPTSentencePieceTokenizer": GPTSentencePieceTokenizer,
    "Llama2Tokenizer": Llama2Tokenizer,
}


def make_tokenizer(
    tokenizer_type: str,
    *,
    tokenizer_model: str | None = None,
    vocab_size: int | None = None,
    vocab_file: str | None = None,
    merge_file: str | None = None,
    tiktoken_pattern: str | None = None,
    tiktoken_num_special_tokens: int = 1000,
) -> Tokenizer:
    """Build a tokenizer from Megatron's flags: ``--tokenizer-type``, ``--tokenizer-model``,
    ``--vocab-size`` (NullTokenizer, TikTokenizer), ``--vocab-file`` / ``--merge-file``
    (GPT2BPETokenizer), ``--tiktoken-pattern`` / ``--tiktoken-num-special-tokens``. A file
    that cannot be read as that tokenizer is a ``TokenizerError`` naming the flag and the file."""
    files = {"--tokenizer-model": tokenizer_model, "--vocab-file": vocab_file}
    files["--merge-file"] = merge_file
    try:
        return _make_tokenizer(
            tokenizer_type,
            tokenizer_model=tokenizer_model,
            vocab_size=vocab_size,
            vocab_file=vocab_file,
            merge_file=merge_file,
            tiktoken_pattern=tiktoken_pattern,
            tiktoken_num_special_tokens=tiktoken_num_special_tokens,
        )
    except UserError:
        raise
    except (OSError, ValueError, RuntimeError, KeyError, TypeError, IndexError) as e:
        named = ", ".join(f"{flag} {path}" for flag, path in files.items() if path)
        raise TokenizerError(
            f"--tokenizer-type {tokenizer_type}: cannot read {named or 'its files'} "
            f"({type(e).__name__}: {one_line(str(e))[:200]}); pass files of that tokenizer type"
        ) from None


def _make_tokenizer(
    tokenizer_type: str,
    *,
    tokenizer_model: str | None,
    vocab_size: int | None,
    vocab_file: str | None,
    merge_file: str | None,
    tiktoken_pattern: str | None,
    tiktoken_num_special_tokens: int,
) -> Tokenizer:
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None:
            raise TokenizerError("--tokenizer-type NullTokenizer needs --vocab-size V (eod is V)")
        return NullTokenizer(vocab_size)
    if tokenizer_type == "GPT2BPETokenizer":
        if not vocab_file or not merge_file:
            raise TokenizerError(
                "--tokenizer-type GPT2BPETokenizer needs --vocab-file (vocab.json) and "
                "--merge-file (merges.txt)"
            )
        from megalite.data.gpt2_bpe import GPT2BPETokenizer

        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type not in TOKENIZER_TYPES:
        raise TokenizerError(
            f"--tokenizer-type {tokenizer_type!r} is not supported; use one of "
            f"{', '.join(TOKENIZER_TYPES)}"
        )
    if not tokenizer_model:
        raise TokenizerError(f"--tokenizer-type {tokenizer_type} needs --tokenizer-model")
    if tokenizer_type == "TikTokenizer":
        from megalite.data.tiktoken_tokenizer import TikTokenizer

        return TikTokenizer(
            tokenizer_model,
            pattern=tiktoken_pattern,
            vocab_size=vocab_size,
            num_special_tokens=tiktoken_num_special_tokens,
        )
    if tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(tokenizer_model)
    return _SENTENCEPIECE[tokenizer_type](tokenizer_model)


def build_tokenizer(cfg: DataConfig) -> Tokenizer:
    """The tokenizer ``cfg`` names (``.vocab_size`` unpadded, ``.eod``, tokenize/detokenize)."""
    return make_tokenizer(
        cfg.tokenizer_type,
        tokenizer_model=cfg.tokenizer_model,
        vocab_size=cfg.vocab_size,
        vocab_file=cfg.vocab_file,
        merge_file=cfg.merge_file,
        tiktoken_pattern=cfg.tiktoken_pattern,
        tiktoken_num_special_tokens=cfg.tiktoken_num_special_tokens,
    )


def _is_int(word: str) -> bool:
    try:
        int(word)
    except ValueError:
        return False
    return True


def _none_if_negative(i: int) -> int | None:
    return None if i < 0 else int(i)
